"""A reply as Anthropic's Messages API gives it (actors/tokenizer/anthropic_replies.py): however
the text arrives in pieces, the streamed events follow Anthropic's order and assemble, as a client
SDK assembles them, into the very content of the non-streamed message; thinking blocks carry a
signature that holds their text; stop_reason and usage follow the finished reply."""

from __future__ import annotations

import json
import re
from typing import Any

import msgspec
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from actors.tokenizer.chat_output import unsign
from actors.tokenizer.anthropic_replies import MessageWriter, error_body
from protocol import messages as m

CALL = '<tool_call>\n{"name": "f", "arguments": {"a": 1, "b": "}<x>"}}\n</tool_call>'
TEXTS = [
    '<think>\nplan\n</think>\n\nHello <tool_call>\n{"name": "f", "arguments": {"a": 1}}\n'
    '</tool_call>',
    "<think>\nLet me see: </thi is not the end.\n</think>\n\nThe answer is 4.",
    "Plain answer with <b>tags</b>, 你好 🎉 and a < sign.",
    "Checking.\n" + CALL + "\n" + CALL.replace('"a": 1', '"a": [2, {}]'),
    "<think>hmm</think>\n\n" + CALL + "\nAnd some text after the call.",
    "<tool_call>\nnot a call at all\n</tool_call> so text",
    "",
]


def finished(text: str = "", reason: str = "stop", stop_str: str = "", prompt: int = 20,
             cached: int = 0, output: int = 7) -> m.Finished:
    return m.Finished(req_id="r", text=text, token_ids=[], finish_reason=reason,
                      prompt_tokens=prompt, completion_tokens=output, cached_tokens=cached,
                      stop_str=stop_str)


def events(raw: bytes) -> list[dict[str, Any]]:
    """Server-sent events as a client reads them: each named, its data the JSON of its type."""
    text = raw.decode()
    assert text.endswith("\n\n")
    out = []
    for chunk in text[:-2].split("\n\n"):
        name, data = chunk.split("\n")
        assert name.startswith("event: ") and data.startswith("data: ")
        event = json.loads(data[len("data: "):])
        assert event["type"] == name[len("event: "):]
        out.append(event)
    return out


def stream(text: str, cuts: list[int], fin: m.Finished, **writer: Any) -> list[dict[str, Any]]:
    """The reply's text fed in pieces cut at `cuts`, as the relay feeds a writer."""
    w = MessageWriter("qwen3-tiny", tools=writer.pop("tools", True), **writer)
    points = sorted({min(c, len(text)) for c in cuts})
    pieces = [text[a:b] for a, b in zip([0] + points, points + [len(text)])]
    parts = w.begin(fin.prompt_tokens)
    for p in pieces:
        parts += w.text(p)
    parts += w.end(fin)
    return events(b"".join(parts))


def whole(text: str, fin: m.Finished, **writer: Any) -> dict[str, Any]:
    w = MessageWriter("qwen3-tiny", tools=writer.pop("tools", True), **writer)
    return w.whole(msgspec.structs.replace(fin, text=text))  # not streamed: Finished has it


def assemble(evs: list[dict[str, Any]]) -> dict[str, Any]:
    """The message a client SDK builds from the events (anthropic's accumulate_event): blocks
    from their starts, deltas appended, tool input parsed from its JSON pieces at the end, the
    message_delta's stop and usage over the message_start's."""
    message = json.loads(json.dumps(evs[0]["message"]))
    pieces: dict[int, str] = {}
    for e in evs[1:]:
        if e["type"] == "content_block_start":
            message["content"].append(dict(e["content_block"]))
        elif e["type"] == "content_block_delta":
            block, d = message["content"][e["index"]], e["delta"]
            if d["type"] == "text_delta":
                block["text"] += d["text"]
            elif d["type"] == "thinking_delta":
                block["thinking"] += d["thinking"]
            elif d["type"] == "signature_delta":
                block["signature"] = d["signature"]
            elif d["type"] == "input_json_delta":
                pieces[e["index"]] = pieces.get(e["index"], "") + d["partial_json"]
            else:
                raise AssertionError(f"unknown delta {d}")
        elif e["type"] == "message_delta":
            message.update(e["delta"])
            message["usage"].update(e["usage"])
    for k, text in pieces.items():
        message["content"][k]["input"] = json.loads(text)
    return message


def unnamed(blocks: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The blocks without their tool_use ids (each writer makes its own), which are checked
    to be Anthropic's shape of id."""
    for b in blocks:
        assert b["type"] != "tool_use" or re.fullmatch(r"toolu_[0-9a-f]{24}", b["id"])
    return [{k: v for k, v in b.items() if k != "id"} for b in blocks]


def check_order(evs: list[dict[str, Any]]) -> None:
    """Anthropic's event grammar: message_start ping (block_start delta* block_stop)*
    message_delta message_stop, blocks indexed 0, 1, 2... and each delta in its open block."""
    types = [e["type"] for e in evs]
    assert types[:2] == ["message_start", "ping"] and types[-2:] == ["message_delta",
                                                                     "message_stop"]
    open_at, next_index = None, 0
    for e in evs[2:-2]:
        if e["type"] == "content_block_start":
            assert open_at is None and e["index"] == next_index
            open_at, next_index = e["index"], next_index + 1
        elif e["type"] in ("content_block_delta", "content_block_stop"):
            assert e["index"] == open_at
            if e["type"] == "content_block_stop":
                open_at = None
        else:
            raise AssertionError(f"{e['type']} between the blocks")
    assert open_at is None


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(TEXTS), st.lists(st.integers(0, 120), max_size=12))
@example(TEXTS[0], [])
@example(TEXTS[0], list(range(len(TEXTS[0]))))  # a character at a time
@example(TEXTS[3], [9])  # "Checking." then the newline alone before the call
def test_any_split_streams_into_the_whole_message(text, cuts):
    fin = finished(cached=5)
    evs = stream(text, cuts, fin)
    check_order(evs)
    streamed, message = assemble(evs), whole(text, fin)
    assert unnamed(streamed["content"]) == unnamed(message["content"])
    for field in ("type", "role", "model", "stop_reason", "stop_sequence", "usage"):
        assert streamed[field] == message[field], field


def test_the_blocks_of_a_reply_that_thinks_speaks_and_calls():
    message = whole(TEXTS[0], finished())
    thinking, text, call = message["content"]
    assert thinking == {"type": "thinking", "thinking": "\nplan\n",
                        "signature": thinking["signature"]}
    assert unsign(thinking["signature"]) == "\nplan\n"
    assert text == {"type": "text", "text": "Hello "}  # as chat completions' content
    assert call["type"] == "tool_use" and call["id"].startswith("toolu_")
    assert (call["name"], call["input"]) == ("f", {"a": 1})
    assert message["stop_reason"] == "tool_use" and message["id"].startswith("msg_")
    assert (message["type"], message["role"], message["model"]) == \
        ("message", "assistant", "qwen3-tiny")


def test_a_thinking_block_streams_its_signature_before_it_stops():
    evs = stream(TEXTS[1], [3, 20], finished())
    deltas = [e["delta"] for e in evs if e["type"] == "content_block_delta" and e["index"] == 0]
    assert [d["type"] for d in deltas][-1] == "signature_delta"
    thought = "".join(d.get("thinking", "") for d in deltas)
    assert thought == "\nLet me see: </thi is not the end.\n"
    assert unsign(deltas[-1]["signature"]) == thought
    assert evs[2]["content_block"] == {"type": "thinking", "thinking": "", "signature": ""}


@pytest.mark.parametrize("cuts", [[], [1, 5, 12]])
def test_omitted_thinking_is_empty_with_a_signature_that_holds_it(cuts):
    fin = finished()
    evs = stream(TEXTS[1], cuts, fin, omit_thinking=True)
    assert not [e for e in evs if e.get("delta", {}).get("type") == "thinking_delta"]
    for message in (assemble(evs), whole(TEXTS[1], fin, omit_thinking=True)):
        block = message["content"][0]
        assert block["type"] == "thinking" and block["thinking"] == ""
        assert unsign(block["signature"]) == "\nLet me see: </thi is not the end.\n"
        assert message["content"][1] == {"type": "text", "text": "The answer is 4."}


def test_without_tools_a_tool_call_is_text():
    message = whole(CALL, finished(), tools=False)
    assert message["content"] == [{"type": "text", "text": CALL}]
    assert message["stop_reason"] == "end_turn"


def test_a_call_cut_by_max_tokens_has_an_empty_input_and_stops_for_max_tokens():
    message = whole('<tool_call>\n{"name": "f", "arguments": {"a": "}', finished(reason="length"))
    (call,) = message["content"]
    assert (call["type"], call["name"], call["input"]) == ("tool_use", "f", {})
    assert message["stop_reason"] == "max_tokens"


@pytest.mark.parametrize("text, reason, stop_str, expected", [
    ("Hi", "length", "", "max_tokens"),
    (CALL, "length", "", "max_tokens"),
    (CALL, "stop", "", "tool_use"),
    ("Hi", "stop", "END", "stop_sequence"),
    ("Hi", "stop", "", "end_turn"),
])
def test_stop_reason(text, reason, stop_str, expected):
    fin = finished(reason=reason, stop_str=stop_str)
    message = whole(text, fin)
    assert message["stop_reason"] == expected
    assert message["stop_sequence"] == (stop_str or None)
    (delta,) = [e for e in stream(text, [], fin) if e["type"] == "message_delta"]
    assert delta["delta"] == {"stop_reason": expected, "stop_sequence": stop_str or None}


def test_usage_counts_the_cached_prompt_apart():
    fin = finished(prompt=100, cached=64, output=9)
    usage = {"input_tokens": 36, "cache_creation_input_tokens": 0,
             "cache_read_input_tokens": 64, "output_tokens": 9}
    assert whole("Hi", fin)["usage"] == usage
    evs = stream("Hi", [], fin)
    # message_start knows the prompt, not yet what of it was cached; message_delta has it all
    assert evs[0]["message"]["usage"]["input_tokens"] + \
        evs[0]["message"]["usage"]["cache_read_input_tokens"] == 100
    assert evs[0]["message"]["usage"]["output_tokens"] == 0
    assert evs[-2]["usage"] == usage and assemble(evs)["usage"] == usage
    assert evs[0]["message"]["stop_reason"] is None and evs[0]["message"]["content"] == []


def test_an_empty_reply_is_a_message_with_no_blocks():
    message = whole("", finished(output=0))
    assert message["content"] == [] and message["stop_reason"] == "end_turn"
    evs = stream("", [], finished(output=0))
    assert [e["type"] for e in evs] == ["message_start", "ping", "message_delta",
                                        "message_stop"]


def test_a_failure_mid_stream_is_an_error_event():
    w = MessageWriter("qwen3-tiny", tools=False)
    evs = events(b"".join(w.begin(3) + w.text("Hel") + w.failed(503, "draining")))
    assert evs[-1] == {"type": "error", "error": {"type": "overloaded_error",
                                                  "message": "draining"}}


@pytest.mark.parametrize("status, kind", [
    (400, "invalid_request_error"), (401, "authentication_error"), (404, "not_found_error"),
    (413, "request_too_large"), (429, "rate_limit_error"), (500, "api_error"),
    (503, "overloaded_error"), (418, "api_error")])
def test_error_bodies(status, kind):
    assert error_body(status, "why") == {"type": "error", "error": {"type": kind,
                                                                    "message": "why"}}
