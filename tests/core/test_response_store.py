"""The responses kept for previous_response_id (actors/tokenizer/response_store.py): least
recently used dropped past a count or a size, an entry larger than the whole store not kept
(and dropping nothing), and the byte count always the sum of what is kept."""

from __future__ import annotations

import msgspec
from hypothesis import given, settings
from hypothesis import strategies as st

from actors.tokenizer.openai_format import ChatMessageBody
from actors.tokenizer.response_store import ResponseStore

TURN = [ChatMessageBody(role="user", content="Hi"),
        ChatMessageBody(role="assistant", content="Hello")]


def response(rid: str, pad: int = 0) -> dict:
    return {"id": rid, "object": "response", "output": [], "pad": "x" * pad}


def size(rid: str, pad: int = 0) -> int:
    """An entry's size: the JSON of its response and conversation."""
    return len(msgspec.json.encode(response(rid, pad))) + len(msgspec.json.encode(TURN))


def kept(store: ResponseStore) -> list[str]:
    return list(store.entries)  # least recently used first


def fill(store: ResponseStore, *rids: str, pad: int = 0) -> None:
    for rid in rids:
        store.put(response(rid, pad), TURN)


def test_get_gives_the_response_and_its_conversation():
    store = ResponseStore(4, 1 << 20)
    fill(store, "a")
    entry = store.get("a")
    assert entry.response["id"] == "a" and entry.conversation == TURN
    assert entry.size == size("a") == store.bytes
    assert store.get("nope") is None


def test_past_max_items_the_least_recently_used_goes():
    store = ResponseStore(3, 1 << 20)
    fill(store, "a", "b", "c")
    assert store.get("a") is not None  # a is now the most recent
    fill(store, "d")
    assert kept(store) == ["c", "a", "d"]
    fill(store, "c")  # put again: replaced, and the most recent
    fill(store, "e")
    assert kept(store) == ["d", "c", "e"]
    assert store.bytes == sum(size(r) for r in "dce")


def test_past_max_bytes_the_least_recently_used_go_until_it_fits():
    one = size("a", 100)
    store = ResponseStore(100, 3 * one)
    fill(store, "a", "b", "c", pad=100)
    assert kept(store) == ["a", "b", "c"] and store.bytes == 3 * one
    store.get("a")
    store.put(response("d", 100 + one), TURN)  # two entries' worth: b and c go
    assert kept(store) == ["a", "d"] and store.bytes == one + size("d", 100 + one)


def test_an_entry_larger_than_the_store_is_not_kept_and_drops_nothing():
    store = ResponseStore(10, size("a", 50))
    fill(store, "a", pad=50)
    store.put(response("big", 51), TURN)
    assert kept(store) == ["a"] and store.get("big") is None
    # Nor does a too-large put under a kept id replace or drop it.
    store.put(response("a", 51), TURN)
    assert store.get("a").response["pad"] == "x" * 50


def test_a_store_of_zero_items_or_bytes_keeps_nothing():
    for store in (ResponseStore(0, 1 << 20), ResponseStore(10, 0)):
        fill(store, "a")
        assert kept(store) == [] and store.bytes == 0


def test_delete():
    store = ResponseStore(4, 1 << 20)
    fill(store, "a", "b")
    assert store.delete("a") and not store.delete("a") and not store.delete("never")
    assert kept(store) == ["b"] and store.bytes == size("b")
    assert store.delete("b") and store.bytes == 0 and store.get("b") is None


OPS = st.lists(st.tuples(st.sampled_from(["put", "get", "delete"]),
                         st.sampled_from("abcdef"), st.integers(0, 300)), max_size=40)


@settings(max_examples=300, deadline=None)
@given(st.integers(0, 4), st.integers(0, 1200), OPS)
def test_any_sequence_keeps_the_most_recently_used_that_fit(max_items, max_bytes, ops):
    store = ResponseStore(max_items, max_bytes)
    model: dict[str, int] = {}  # id -> size, least recently used first
    for op, rid, pad in ops:
        if op == "put":
            store.put(response(rid, pad), TURN)
            if size(rid, pad) <= max_bytes and max_items:
                model.pop(rid, None)
                model[rid] = size(rid, pad)
                while len(model) > max_items or sum(model.values()) > max_bytes:
                    model.pop(next(iter(model)))
        elif op == "get":
            assert (store.get(rid) is None) == (rid not in model)
            if rid in model:
                model[rid] = model.pop(rid)
        else:
            assert store.delete(rid) == (rid in model)
            model.pop(rid, None)
        assert kept(store) == list(model)
        assert store.bytes == sum(model.values()) == sum(e.size for e in store.entries.values())
        assert len(store.entries) <= max_items and store.bytes <= max_bytes
