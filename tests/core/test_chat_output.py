"""A chat reply split into reasoning, content and tool calls (actors/tokenizer/chat_output.py):
however the text arrives in pieces, the streamed deltas assemble into exactly the non-streamed
message, and tool-call arguments arrive as the model's own JSON text."""

from __future__ import annotations

import json

from hypothesis import example, given, settings
from hypothesis import strategies as st

from actors.tokenizer.chat_output import ChatOutput, whole_message

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "days": [1, 2]}}\n' \
       '</tool_call>'
TEXTS = [
    "<think>\nLet me see: </thi is not the end.\n</think>\n\nThe answer is 4.",
    "Plain answer with <b>tags</b> and a < sign.",
    "Checking.\n" + CALL + "\n" + CALL.replace("Oslo", "Paris"),
    "<think>hmm</think>\n\n" + CALL,
    "<tool_call>\nnot a call at all\n</tool_call> so text",
    '<tool_call>\n{"name": "f", "arguments": {"a": "}"}}',  # cut by max_tokens mid-call
]


def _assemble(deltas):
    content = "".join(d.get("content", "") for d in deltas)
    thought = "".join(d.get("reasoning_content", "") for d in deltas)
    calls = {}
    for d in deltas:
        for c in d.get("tool_calls", []):
            entry = calls.setdefault(c["index"], {"name": None, "arguments": ""})
            if "id" in c:
                assert entry["name"] is None  # the head comes once, first
                entry["name"] = c["function"]["name"]
            entry["arguments"] += c["function"]["arguments"]
    return content, thought, [calls[i] for i in sorted(calls)]


def _whole(text):
    message, _ = whole_message(text, reasoning=True, tools=True)
    calls = [{"name": c["function"]["name"], "arguments": c["function"]["arguments"]}
             for c in message.get("tool_calls", [])]
    return message["content"] or "", message.get("reasoning_content", ""), calls


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(TEXTS), st.lists(st.integers(0, 200), max_size=12))
@example(TEXTS[2], [9])  # "Checking." then "\n<tool_call>...": the newline arrives alone
@example(TEXTS[2] + "\n", [len(TEXTS[2])])  # whitespace after the last call: dropped
@example("Hello \n", [5])
def test_any_split_streams_into_the_whole_message(text, cuts):
    points = sorted({min(c, len(text)) for c in cuts})
    pieces = [text[a:b] for a, b in zip([0] + points, points + [len(text)])]
    parser = ChatOutput(reasoning=True, tools=True)
    deltas = [d for p in pieces for d in parser.feed(p)] + parser.finish()
    assert _assemble(deltas) == _whole(text)


def test_each_part_lands_in_its_field():
    content, thought, calls = _whole(TEXTS[0])
    assert thought == "\nLet me see: </thi is not the end.\n" and content == "The answer is 4."
    content, thought, calls = _whole(TEXTS[2])
    assert content == "Checking.\n" and thought == ""
    assert [c["name"] for c in calls] == ["get_weather", "get_weather"]
    assert [json.loads(c["arguments"])["city"] for c in calls] == ["Oslo", "Paris"]
    assert calls[0]["arguments"] == '{"city": "Oslo", "days": [1, 2]}'
    message, called = whole_message(TEXTS[3], reasoning=True, tools=True)
    assert called and message["content"] is None and message["reasoning_content"] == "hmm"
    content, _, calls = _whole(TEXTS[4])  # no call head: the block stays text
    assert not calls and content == TEXTS[4]


def test_without_tools_a_call_is_content_and_without_reasoning_think_is_too():
    message, called = whole_message(TEXTS[2], reasoning=True, tools=False)
    assert not called and message["content"] == TEXTS[2]
    message, _ = whole_message(TEXTS[0], reasoning=False, tools=False)
    assert message["content"] == TEXTS[0] and "reasoning_content" not in message


def test_arguments_stream_before_the_call_ends():
    parser = ChatOutput(reasoning=True, tools=True)
    deltas = parser.feed('<tool_call>\n{"name": "f", "arguments": {"city": "Os')
    assert deltas[0]["tool_calls"][0]["function"] == {"name": "f", "arguments": ""}
    assert _assemble(deltas)[2][0]["arguments"] == '{"city": "O'  # all but the last character
