"""Each family's chat template comes from its own tokenizer files (models/tokenizer.py): the
template in tokenizer_config.json (or chat_template.jinja) is what a chat request renders."""

import json
import shutil

import pytest

from models.builtin import ensure_builtin
from models.tokenizer import load_tokenizer

# Llama 3's turn markup, written out here: nothing of Qwen's <|im_start|> in it.
LLAMA3 = ("{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}"
          "<|end_header_id|>\n\n{{ m['content'] }}<|eot_id|>{% endfor %}"
          "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n"
          "{% endif %}")
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]


@pytest.fixture
def folder(tmp_path, model_cache):
    source = ensure_builtin("qwen3-tiny", cache_dir=model_cache, progress=False)
    for name in ("tokenizer.json", "tokenizer_config.json", "config.json"):
        shutil.copy(source / name, tmp_path / name)
    (tmp_path / "chat_template.jinja").unlink(missing_ok=True)
    return tmp_path


def test_the_builtin_renders_qwens_template(folder):
    tok = load_tokenizer(str(folder))
    text = tok.decode(tok.apply_chat_template(MESSAGES))
    assert text.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")


@pytest.mark.parametrize("where", ["tokenizer_config.json", "chat_template.jinja"])
def test_a_family_renders_the_template_its_files_carry(folder, where):
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    config["bos_token"] = "<|endoftext|>"
    if where == "chat_template.jinja":
        (folder / where).write_text(LLAMA3)
    else:
        config["chat_template"] = LLAMA3
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    tok = load_tokenizer(str(folder))
    text = tok.decode(tok.apply_chat_template(MESSAGES))
    assert text == ("<|endoftext|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
                    "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
                    "<|start_header_id|>assistant<|end_header_id|>\n\n")


def test_a_tokenizer_without_a_template_refuses_chat_by_name(folder):
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="no chat template"):
        load_tokenizer(str(folder)).apply_chat_template(MESSAGES)
