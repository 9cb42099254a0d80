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


# -- the same text as transformers renders -----------------------------------------------------

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}]
CONVERSATIONS = {
    "plain": [{"role": "user", "content": "Wie geht's? 你好 <b>"}],
    "system": MESSAGES,
    "turns": [*MESSAGES, {"role": "assistant", "content": "Hello."},
              {"role": "user", "content": "And now?"}],
    "tool call": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [{
            "type": "function", "function": {"name": "get_weather",
                                             "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "content": "{\"sky\": \"clear\"}"},
        {"role": "user", "content": "Thanks"}],
    "reasoning": [{"role": "user", "content": "2+2?"},
                  {"role": "assistant", "content": "4", "reasoning_content": "adding"},
                  {"role": "user", "content": "3+3?"}],
}


@pytest.fixture(scope="module")
def both_tokenizers(model_cache):
    """(transformers' tokenizer, ours) per built-in, loaded once for the 30 cases below:
    transformers takes seconds to build one from the BPE files."""
    transformers = pytest.importorskip("transformers")
    loaded = {}

    def get(builtin: str):
        if builtin not in loaded:
            path = str(ensure_builtin(builtin, cache_dir=model_cache, progress=False))
            loaded[builtin] = (transformers.AutoTokenizer.from_pretrained(path),
                               load_tokenizer(path))
        return loaded[builtin]
    return get


@pytest.mark.parametrize("builtin", ["qwen3-tiny", "qwen3_5-tiny"])
@pytest.mark.parametrize("conversation", sorted(CONVERSATIONS))
@pytest.mark.parametrize("extra", [{}, {"tools": TOOLS}, {"enable_thinking": False}])
def test_jinja_rendering_equals_transformers(both_tokenizers, builtin, conversation, extra):
    hf, tok = both_tokenizers(builtin)
    messages = CONVERSATIONS[conversation]
    want = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **extra)
    assert tok.template.render(messages, **extra) == want
    assert tok.apply_chat_template(messages, **extra) == hf.encode(want,
                                                                   add_special_tokens=False)


def test_named_templates_pick_tool_use_when_tools_are_given(folder):
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = [
        {"name": "default", "template": "plain:{{ messages[0]['content'] }}"},
        {"name": "tool_use", "template": "tools:{{ tools | length }}:{{ tools[0] | tojson }}"}]
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    tok = load_tokenizer(str(folder))
    assert tok.template.render(MESSAGES) == "plain:Be brief."
    # tojson keeps non-ASCII and HTML characters as they are, as HF's does.
    tools = [{"name": "ü<&>"}]
    assert tok.template.render(MESSAGES, tools=tools) == 'tools:1:{"name": "ü<&>"}'


def test_generation_tags_render_their_body_and_raise_exception_is_an_error(folder):
    (folder / "chat_template.jinja").write_text(
        "{% for m in messages %}{% if m['role'] == 'tool' %}"
        "{{ raise_exception('no tools here') }}{% endif %}"
        "{% generation %}[{{ m['content'] }}]{% endgeneration %}{% endfor %}")
    tok = load_tokenizer(str(folder))
    assert tok.template.render(MESSAGES) == "[Be brief.][Hi]"
    with pytest.raises(Exception, match="no tools here"):
        tok.apply_chat_template([{"role": "tool", "content": "x"}])


def test_a_template_cannot_reach_python_internals(folder):
    (folder / "chat_template.jinja").write_text("{{ messages.__class__.__mro__ }}")
    with pytest.raises(Exception, match="unsafe|access"):
        load_tokenizer(str(folder)).apply_chat_template(MESSAGES)


def test_continue_final_message_goes_on_from_the_assistants_text(folder):
    """Anthropic's assistant prefill (vLLM's continue_final_message): the prompt ends with
    the final assistant message's text, not with that turn closed and a new one opened."""
    tok = load_tokenizer(str(folder))
    turns = [*MESSAGES, {"role": "assistant", "content": "The answer is"}]
    opened = tok.apply_chat_template(MESSAGES)
    continued = tok.apply_chat_template(turns, continue_final_message=True)
    assert tok.decode(continued) == tok.decode(opened) + "The answer is"
    closed = tok.decode(tok.apply_chat_template(turns))
    assert closed.count("<|im_start|>assistant") == 2  # without it: a turn closed, one opened
