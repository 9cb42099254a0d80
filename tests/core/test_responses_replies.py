"""A reply as OpenAI's Responses API gives it (actors/tokenizer/responses_replies.py): however the
reply's text arrives in pieces, the output items a client assembles from the streamed events are
the non-streamed response's; the events come in order with sequence numbers 0, 1, 2, ...; the
reasoning is sealed only when asked; and `message`, the turn kept for previous_response_id,
holds the reply as the model wrote it (shown tool names)."""

from __future__ import annotations

import copy
import json
from typing import Any

import msgspec
from hypothesis import example, given, settings
from hypothesis import strategies as st

from actors.tokenizer.chat_output import unsign
from actors.tokenizer.responses_format import parse_responses
from actors.tokenizer.responses_replies import ResponseWriter
from protocol import messages as m
from protocol.config import LimitsConfig

NS = {"type": "namespace", "name": "ns", "tools": [{"type": "function", "name": "f"}]}
FN = {"type": "function", "name": "g"}
TEXT = ('<think>\nplan\n</think>\n\nHello <tool_call>\n{"name": "ns.f", "arguments": {"a": 1}}'
        '\n</tool_call>')
TEXTS = [
    TEXT,
    "Just text, with a < sign and </think> in it.",
    "<think>only thought</think>",
    '<tool_call>\n{"name": "g", "arguments": {}}\n</tool_call>\n<tool_call>\n{"name": "ns.f", '
    '"arguments": {"a": [1, "}"]}}\n</tool_call>',
    '<think>x</think>\n\nCut <tool_call>\n{"name": "g", "arguments": {"a": "',  # cut mid-call
    "",
]
TERMINAL = {"response.completed", "response.incomplete", "response.failed"}


def writer(**fields: Any) -> ResponseWriter:
    body = {"model": "gpt-x", "input": "Hi", "tools": [NS, FN], **fields}
    return ResponseWriter("qwen3-tiny", parse_responses(json.dumps(body).encode(),
                                                         LimitsConfig()))


def finished(text: str = "", reason: str = "stop") -> m.Finished:
    return m.Finished(req_id="r", text=text, token_ids=[], finish_reason=reason,
                      prompt_tokens=12, completion_tokens=7, cached_tokens=5)


def decode(chunks: list[bytes]) -> list[dict[str, Any]]:
    """Server-sent events -> their data; each event's name is its data's type."""
    out = []
    for event in b"".join(chunks).split(b"\n\n")[:-1]:
        name, data = event.split(b"\n")
        assert name.startswith(b"event: ") and data.startswith(b"data: ")
        out.append(json.loads(data[len(b"data: "):]))
        assert out[-1]["type"] == name[len(b"event: "):].decode()
    return out


def streamed(w: ResponseWriter, pieces: list[str], reason: str = "stop") -> list[dict]:
    return decode(w.begin(12) + [e for p in pieces for e in w.text(p)] +
                  w.end(finished("", reason)))


def split(text: str, cuts: list[int]) -> list[str]:
    points = sorted({min(c, len(text)) for c in cuts})
    return [text[a:b] for a, b in zip([0] + points, points + [len(text)])]


def anonymous(value: Any) -> Any:
    """ids (random per writer) as their order of appearance: id0, id1, ..."""
    names: dict[str, str] = {}

    def walk(v: Any) -> Any:
        if isinstance(v, dict):
            return {k: names.setdefault(x, f"id{len(names)}")
                    if k in ("id", "call_id", "item_id") and isinstance(x, str) else walk(x)
                    for k, x in v.items()}
        return [walk(x) for x in v] if isinstance(v, list) else v
    return walk(value)


def assemble(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The output items as a client builds them from the events, checking each .done event
    against what the deltas built: the items of output_item.done, in order."""
    building: list[dict[str, Any]] = []
    done: list[dict[str, Any]] = []
    for e in events:
        kind = e["type"]
        if kind == "response.output_item.added":
            assert e["output_index"] == len(building) == len(done)  # one item open at a time
            building.append(copy.deepcopy(e["item"]))
            continue
        if not kind.startswith("response.") or kind in TERMINAL or \
                kind in ("response.created", "response.in_progress"):
            continue
        at = e["output_index"]
        assert at == len(building) - 1 == len(done)  # events of the open item only
        item = building[at]
        assert e.get("item_id", item["id"]) == item["id"]
        if kind == "response.content_part.added":
            assert e["content_index"] == len(item["content"])
            item["content"].append(copy.deepcopy(e["part"]))
        elif kind in ("response.output_text.delta", "response.reasoning_text.delta"):
            item["content"][e["content_index"]]["text"] += e["delta"]
        elif kind in ("response.output_text.done", "response.reasoning_text.done"):
            assert e["text"] == item["content"][e["content_index"]]["text"]
        elif kind == "response.content_part.done":
            assert e["part"] == item["content"][e["content_index"]]
        elif kind == "response.function_call_arguments.delta":
            item["arguments"] += e["delta"]
        elif kind == "response.function_call_arguments.done":
            assert e["arguments"] == item["arguments"] and e["name"] == item["name"]
        elif kind == "response.output_item.done":
            final = e["item"]
            # What only the end says: the status, and the reasoning's seal.
            built = {**item, **{k: final[k] for k in ("status", "encrypted_content")
                                if k in final}}
            assert built == final
            done.append(final)
        else:
            raise AssertionError(f"unexpected event {kind}")
    assert len(done) == len(building)  # every item closed
    return done


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(TEXTS), st.lists(st.integers(0, 120), max_size=10), st.booleans(),
       st.sampled_from(["stop", "length"]))
@example(TEXT, [], True, "stop")
@example(TEXT, list(range(len(TEXT))), True, "stop")  # a character at a time
def test_any_split_streams_into_the_whole_response(text, cuts, sealed, reason):
    include = ["reasoning.encrypted_content"] if sealed else []
    whole_writer = writer(include=include)
    whole = whole_writer.whole(finished(text, reason))
    w = writer(include=include)
    events = streamed(w, split(text, cuts), reason)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert [e["type"] for e in events[:2]] == ["response.created", "response.in_progress"]
    assert events[-1]["type"] == ("response.incomplete" if reason == "length"
                                  else "response.completed")
    assert sum(e["type"] in TERMINAL for e in events) == 1
    output = assemble(events)
    assert anonymous(output) == anonymous(whole["output"])
    assert anonymous(events[-1]["response"]) == anonymous(
        {**whole, "created_at": events[-1]["response"]["created_at"]})
    assert anonymous(msgspec.to_builtins(w.message)) == \
        anonymous(msgspec.to_builtins(whole_writer.message))


def test_the_items_of_a_reply_that_thinks_speaks_and_calls():
    w = writer(include=["reasoning.encrypted_content"])
    r = w.whole(finished(TEXT))
    reasoning, message, call = r["output"]
    assert reasoning["type"] == "reasoning" and reasoning["summary"] == []
    assert reasoning["content"] == [{"type": "reasoning_text", "text": "\nplan\n"}]
    assert unsign(reasoning["encrypted_content"]) == "\nplan\n"
    assert message["type"] == "message" and message["role"] == "assistant"
    assert message["status"] == "completed"
    assert [(p["type"], p["text"]) for p in message["content"]] == [("output_text", "Hello ")]
    assert call["type"] == "function_call" and call["status"] == "completed"
    assert (call["name"], call["namespace"], call["arguments"]) == ("f", "ns", '{"a": 1}')
    assert call["call_id"].startswith("call_") and "shown" not in call
    assert len({i["id"] for i in r["output"]}) == 3
    assert (r["status"], r["incomplete_details"], r["error"]) == ("completed", None, None)
    assert r["usage"] == {"input_tokens": 12, "input_tokens_details": {"cached_tokens": 5},
                          "output_tokens": 7, "output_tokens_details": {"reasoning_tokens": 0},
                          "total_tokens": 19}
    assert r["id"] == w.id and r["id"].startswith("resp_") and r["object"] == "response"


def test_reasoning_is_sealed_only_when_included_and_only_once_done():
    r = writer().whole(finished(TEXT))
    assert "encrypted_content" not in r["output"][0]
    events = streamed(writer(include=["reasoning.encrypted_content"]), [TEXT])
    [added] = [e for e in events if e["type"] == "response.output_item.added"
               and e["item"]["type"] == "reasoning"]
    assert "encrypted_content" not in added["item"] and added["item"]["content"] == []
    [done] = [e for e in events if e["type"] == "response.output_item.done"
              and e["item"]["type"] == "reasoning"]
    assert unsign(done["item"]["encrypted_content"]) == "\nplan\n"


def test_message_is_the_turn_as_the_model_wrote_it_with_shown_names():
    w = writer()
    r = w.whole(finished(TEXT))
    call = r["output"][2]
    assert w.message.role == "assistant" and w.message.reasoning_content == "\nplan\n"
    assert w.message.content == "Hello "
    assert w.message.tool_calls == [{"id": call["call_id"], "type": "function",
                                     "function": {"name": "ns.f", "arguments": '{"a": 1}'}}]


def test_a_plain_function_call_has_no_namespace():
    r = writer().whole(finished(TEXTS[3]))
    assert [(c["name"], c.get("namespace"), json.loads(c["arguments"])) for c in r["output"]] \
        == [("g", None, {}), ("f", "ns", {"a": [1, "}"]})]


def test_without_tools_a_call_is_text():
    w = writer(tools=None)
    _, message = w.whole(finished(TEXT))["output"]
    assert message["content"][0]["text"] == TEXT.split("</think>\n\n")[1]
    assert w.message.tool_calls is None
    _, message = writer(tool_choice="none").whole(finished(TEXT))["output"]
    assert "<tool_call>" in message["content"][0]["text"]


def test_a_reply_cut_by_max_output_tokens_is_incomplete():
    r = writer(max_output_tokens=7).whole(finished("Hello wor", "length"))
    assert r["status"] == "incomplete" and r["max_output_tokens"] == 7
    assert r["incomplete_details"] == {"reason": "max_output_tokens"}
    assert r["output"][0]["content"][0]["text"] == "Hello wor"
    events = streamed(writer(), ["Hello", " wor"], reason="length")
    assert events[-1]["type"] == "response.incomplete"
    assert events[-1]["response"]["incomplete_details"] == {"reason": "max_output_tokens"}


def test_a_call_cut_mid_arguments_keeps_what_came():
    r = writer().whole(finished(TEXTS[4], "length"))
    assert [i["type"] for i in r["output"]] == ["reasoning", "message", "function_call"]
    assert r["output"][2]["arguments"] == '{"a": "'


def test_an_empty_reply_has_no_items():
    w = writer()
    assert w.whole(finished(""))["output"] == [] and w.message.content == ""
    events = streamed(writer(), [])
    assert [e["type"] for e in events] == ["response.created", "response.in_progress",
                                           "response.completed"]


def test_a_failure_mid_stream_ends_with_response_failed():
    w = writer()
    events = decode(w.begin(12) + w.text("Hel") + w.failed(503, "the server is draining"))
    last = events[-1]
    assert last["type"] == "response.failed" and last["sequence_number"] == len(events) - 1
    assert last["response"]["status"] == "failed"
    assert last["response"]["error"] == {"code": "server_error",
                                         "message": "the server is draining"}
    assert writer().failed(400, "bad")[0].count(b"invalid_request") == 1


def test_a_failure_mid_call_shows_the_call_so_far_as_the_api_has_it():
    w = writer()
    events = decode(w.begin(12) + w.text('<tool_call>\n{"name": "ns.f", "arguments": {"a"') +
                    w.failed(500, "internal error"))
    [item] = events[-1]["response"]["output"]
    assert item == {"type": "function_call", "id": item["id"], "call_id": item["call_id"],
                    "name": "f", "namespace": "ns", "arguments": '{"a', "status": "in_progress"}


def test_the_response_echoes_the_request():
    fields = dict(instructions="Be terse.", max_output_tokens=9, temperature=0.5, top_p=0.9,
                  tool_choice="none", parallel_tool_calls=False, store=False,
                  previous_response_id=None, metadata={"k": "v"},
                  reasoning={"effort": "low", "summary": "auto"},
                  text={"format": {"type": "json_schema", "name": "n",
                                   "schema": {"type": "object"}}})
    r = writer(**fields).whole(finished('<tool_call>\n{"name": "g", "arguments": {}}\n'
                                        '</tool_call>'))
    for k in ("instructions", "max_output_tokens", "temperature", "top_p", "tool_choice",
              "parallel_tool_calls", "store", "metadata"):
        assert r[k] == fields[k], k
    assert r["tools"] == [NS, FN] and r["reasoning"] == {"effort": "low", "summary": "auto"}
    assert r["text"]["format"]["type"] == "json_schema"
    assert r["text"]["format"]["schema"] == {"type": "object"}
    d = writer().whole(finished("x"))
    assert (d["temperature"], d["top_p"], d["tool_choice"], d["text"], d["store"]) == \
        (1.0, 1.0, "auto", {"format": {"type": "text"}}, True)
