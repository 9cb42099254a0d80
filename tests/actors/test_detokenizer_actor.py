"""The detokenizer actor in its own process, over real sockets: the test plays the scheduler
(pushing TokenBatches into its inbox) and the tokenizer (a PULL inbox receiving TextBatches).
Text is checked against the real Qwen tokenizer of qwen3-tiny, loaded here the way the actor
loads it (models.tokenizer.load_tokenizer)."""

from __future__ import annotations

import itertools

import pytest

from protocol import messages as m
from protocol.codec import pack_ids
from tests.support.rig import Kept, Rig, make_config

pytestmark = pytest.mark.slow  # starts processes, like tests/e2e

REPLACEMENT = "\ufffd"
_rids = itertools.count()


def start_detokenizer(model) -> Rig:
    rig = Rig("detokenizer", make_config(), model, ("tokenizer",)).start()
    rig.wait_ready()
    return rig


@pytest.fixture(scope="module")
def kept(tiny_model):
    kept = Kept(lambda: start_detokenizer(tiny_model))
    yield kept
    kept.close()


@pytest.fixture
def detok(kept) -> "Detok":
    """The module's detokenizer process (started again if a case stopped it)."""
    rig = kept.get()
    rig.fakes["tokenizer"].drain()
    return Detok(rig)


class Detok:
    """The fake scheduler and the fake tokenizer: one TokenBatch in, its TextBatch out."""

    def __init__(self, rig: Rig):
        self.rig, self.out = rig, rig.fakes["tokenizer"]

    def convert(self, per_rid: dict[str, list[int]], **fields) -> m.TextBatch:
        tb = m.TokenBatch(rids=list(per_rid), counts=[len(ids) for ids in per_rid.values()],
                          token_ids=pack_ids([t for ids in per_rid.values() for t in ids]),
                          **fields)
        self.rig.send(tb)
        text = self.out.expect(m.TextBatch)
        assert (text.counts, text.token_ids) == (tb.counts, tb.token_ids)  # ids pass through
        assert text.rids[:len(tb.rids)] == tb.rids and len(text.texts) == len(text.rids)
        return text

    def stream(self, rid: str, pieces: list[list[int]], last: dict | None = None) -> list[str]:
        """One TokenBatch per piece (the last one with `last`'s fields); the texts per batch."""
        texts = []
        for k, ids in enumerate(pieces):
            fields = last if last and k == len(pieces) - 1 else {}
            texts.append(self.convert({rid: ids}, **fields).texts[0])
        return texts


def new_rid() -> str:
    return f"d{next(_rids)}"


def test_text_is_the_tokenizers_decode_of_the_ids(detok, tokenizer):
    text = "Hello, world! The quick brown fox jumps over the lazy dog.\n  Indented: 42 + 0.5"
    ids = tokenizer.encode(text, add_special_tokens=False)
    pieces = [ids[i:i + 3] for i in range(0, len(ids), 3)]
    rid = new_rid()
    fin = m.Finish(rid=rid, reason="length", prompt_tokens=3, completion_tokens=len(ids))
    texts = detok.stream(rid, pieces, last={"finished": [fin]})
    assert "".join(texts) == tokenizer.decode(ids) == text
    assert all(texts[:-1]), "a batch of plain ASCII tokens produced no text"


def test_a_character_split_across_batches_is_held_back_until_whole(detok, tokenizer):
    text = "Hi 🦙!"
    ids = tokenizer.encode(text, add_special_tokens=False)
    cut = next(k for k in range(1, len(ids)) if tokenizer.decode(ids[:k]).endswith(REPLACEMENT))
    assert tokenizer.decode(ids[:cut + 1]).endswith(REPLACEMENT), "want a cut with 2+ pieces left"
    rid = new_rid()
    first, middle, rest = detok.stream(rid, [ids[:cut], ids[cut:cut + 1], ids[cut + 1:]])
    assert REPLACEMENT not in first + middle and "🦙" not in first + middle
    assert middle == ""  # still no whole character: nothing at all
    assert "🦙" in rest and REPLACEMENT not in rest
    assert first + middle + rest == text


def test_finish_is_forwarded_with_its_counts(detok, tokenizer):
    ids = tokenizer.encode(" done", add_special_tokens=False)
    rid, gone = new_rid(), new_rid()
    fin = m.Finish(rid=rid, reason="length", prompt_tokens=12, completion_tokens=7,
                   cached_tokens=4)
    aborted = m.Finish(rid=gone, reason="abort", prompt_tokens=3, completion_tokens=0)
    out = detok.convert({rid: ids}, finished=[fin, aborted], running=2, queued=5)
    assert out.finished == [fin, aborted]  # every field, as sent
    assert (out.rids, out.texts) == ([rid], [" done"])  # no text for the one that never ran
    assert (out.running, out.queued) == (2, 5)


def test_an_error_finish_keeps_its_message_and_code(detok):
    rid = new_rid()
    fin = m.Finish(rid=rid, reason="error", prompt_tokens=4, completion_tokens=0,
                   message="prompt too long", code=400)
    out = detok.convert({}, finished=[fin])
    assert out.finished == [fin] and out.rids == []


def test_stop_string_is_held_back_and_trimmed(detok, tokenizer):
    """`<` could start the stop string `<end>`: it is held until `b` shows it does not, and the
    stop string itself never reaches the tokenizer."""
    ids = tokenizer.encode("x <b> y <end>", add_special_tokens=False)
    rid = new_rid()
    emitted = ""
    for k in range(len(ids)):
        fields = {"stops": {rid: ["<end>"]}} if k == 0 else {}
        if k == len(ids) - 1:
            fields["finished"] = [m.Finish(rid=rid, reason="stop", prompt_tokens=2,
                                           completion_tokens=len(ids), stop_str="<end>")]
        emitted += detok.convert({rid: ids[k:k + 1]}, **fields).texts[0]
        so_far = tokenizer.decode(ids[:k + 1])
        held = max((n for n in range(1, 5) if so_far.endswith("<end>"[:n])), default=0)
        if k < len(ids) - 1:
            assert emitted == so_far[:len(so_far) - held], f"after {so_far!r}"
    assert emitted == "x <b> y "


def test_a_stop_string_inside_the_last_batch_is_cut(detok, tokenizer):
    ids = tokenizer.encode("Hello there END", add_special_tokens=False)
    rid = new_rid()
    fin = m.Finish(rid=rid, reason="stop", prompt_tokens=1, completion_tokens=len(ids),
                   stop_str=" END")
    out = detok.convert({rid: ids}, stops={rid: [" END"]}, finished=[fin])
    assert out.texts == ["Hello there"] and out.finished == [fin]


def test_eos_ends_the_text_without_appearing_in_it(detok, tokenizer, tiny_model):
    ids = tokenizer.encode("The end.", add_special_tokens=False) + tiny_model.eos_ids[:1]
    rid = new_rid()
    fin = m.Finish(rid=rid, reason="stop", prompt_tokens=1, completion_tokens=len(ids))
    out = detok.convert({rid: ids}, finished=[fin])
    assert out.texts == ["The end."]


def test_requests_in_one_batch_keep_their_own_text(detok, tokenizer):
    a, b = new_rid(), new_rid()
    ta, tb = "alpha beta gamma", "中文 and 日本語"
    ia = tokenizer.encode(ta, add_special_tokens=False)
    ib = tokenizer.encode(tb, add_special_tokens=False)
    got = {a: "", b: ""}
    for k in range(max(len(ia), len(ib))):
        per_rid = {rid: ids[k:k + 1] for rid, ids in ((a, ia), (b, ib)) if k < len(ids)}
        out = detok.convert(per_rid)
        for rid, text in zip(out.rids, out.texts):
            got[rid] += text
    assert got == {a: ta, b: tb}


def test_shutdown_exits_0_and_removes_the_inbox(detok):
    assert detok.rig.shutdown(timeout=10.0) == 0
    assert not detok.rig.inbox_file().exists()
