"""One conversation, one request: the same conversation sent to /v1/chat/completions and to
/v1/responses (actors/tokenizer/responses_format.py) is one GenerateRequest (messages, tools,
template arguments, sampling, grammar), whatever its turns: system and developer messages,
reasoning (as text or sealed), text, calls of plain and namespaced tools and their outputs."""

from __future__ import annotations

import json
from typing import Any

import msgspec
from hypothesis import given, settings
from hypothesis import strategies as st

from actors.tokenizer.chat_output import sign
from actors.tokenizer.openai_format import parse_chat
from actors.tokenizer.responses_format import parse_responses
from protocol import messages as m
from protocol.config import LimitsConfig
from tests.support.response_items import call, output, thought

LIMITS = LimitsConfig()


WORDS = st.text(st.characters(codec="utf-8", exclude_categories=["Cs"]), max_size=12)
NAME = st.from_regex(r"[a-z][a-z_]{0,6}", fullmatch=True)


@st.composite
def conversations(draw) -> dict[str, Any]:
    """One conversation as abstract turns: a system prompt, user and developer messages, and
    assistant turns (reasoning, text, calls of the tools, each answered)."""
    tools = draw(st.lists(st.tuples(st.none() | NAME, NAME, st.none() | WORDS,
                                    st.booleans()), max_size=4,
                          unique_by=lambda t: (t[0], t[1])))
    shown = [f"{ns}.{n}" if ns else n for ns, n, _, _ in tools]
    ids = iter(range(1000))
    flow = [("user", draw(WORDS))]
    for _ in range(draw(st.integers(0, 4))):
        reasoning = draw(st.none() | WORDS)
        text = draw(st.none() | WORDS)
        calls = [(f"call_{next(ids)}", k, json.dumps({"x": draw(WORDS)}))
                 for k in draw(st.lists(st.integers(0, len(tools) - 1), max_size=2))] \
            if tools else []
        if reasoning is None and text is None and not calls:
            text = draw(WORDS)
        flow.append(("assistant", reasoning, text, calls))
        flow += [("tool", c[0], draw(WORDS)) for c in calls]
        if not calls or draw(st.booleans()):
            flow.append((draw(st.sampled_from(["user", "developer"])), draw(WORDS)))
    return {"system": draw(st.none() | WORDS), "tools": tools, "shown": shown, "flow": flow,
            "max": draw(st.integers(1, 4096)), "temperature": draw(st.sampled_from([0, 0.7])),
            "think": draw(st.booleans()), "choice": draw(st.sampled_from(
                ["auto", "none", "required", "named"] if tools else ["auto", "none"])),
            "parallel": draw(st.booleans()), "as_parts": draw(st.booleans()),
            "sealed": draw(st.booleans())}


def as_chat(c: dict[str, Any]) -> bytes:
    msgs: list[dict[str, Any]] = [{"role": "system", "content": c["system"]}] \
        if c["system"] else []
    names = {}
    for turn in c["flow"]:
        if turn[0] == "assistant":
            _, reasoning, text, calls = turn
            msg = {"role": "assistant", "content": text}
            if reasoning is not None:
                msg["reasoning_content"] = reasoning
            if calls:
                msg["tool_calls"] = [{"id": i, "type": "function", "function": {
                    "name": c["shown"][k], "arguments": a}} for i, k, a in calls]
                names.update((i, c["shown"][k]) for i, k, _ in calls)
            msgs.append(msg)
        elif turn[0] == "tool":
            msgs.append({"role": "tool", "tool_call_id": turn[1], "name": names[turn[1]],
                         "content": turn[2]})
        else:
            msgs.append({"role": "system" if turn[0] == "developer" else turn[0],
                         "content": turn[1]})
    tools = [{"type": "function", "function": {
        "name": name, "description": desc,
        "parameters": {"type": "object", "properties": {"x": {"type": "string"}}},
        **({"strict": True} if strict else {})}}
        for name, (_, _, desc, strict) in zip(c["shown"], c["tools"])]
    chat = {"model": "m", "messages": msgs, "max_tokens": c["max"],
            "temperature": c["temperature"], "parallel_tool_calls": c["parallel"],
            "tool_choice": c["choice"] if c["choice"] != "named" else
            {"type": "function", "function": {"name": c["shown"][0]}}}
    if tools:
        chat["tools"] = tools
    if not c["think"]:
        chat["chat_template_kwargs"] = {"enable_thinking": False}
    return json.dumps(chat).encode()


def as_responses(c: dict[str, Any]) -> bytes:
    def content(text: str, kind: str) -> Any:
        return [{"type": kind, "text": text}] if c["as_parts"] else text

    items: list[dict[str, Any]] = []
    for turn in c["flow"]:
        if turn[0] == "assistant":
            _, reasoning, text, calls = turn
            if reasoning is not None:
                items.append({"type": "reasoning", "summary": [], "encrypted_content":
                              sign(reasoning)} if c["sealed"] else thought(reasoning))
            if text is not None:
                items.append({"type": "message", "role": "assistant",
                              "content": content(text, "output_text")})
            for i, k, a in calls:
                ns, name = c["tools"][k][:2]
                items.append(call(i, name, a, **({"namespace": ns} if ns else {})))
        elif turn[0] == "tool":
            items.append(output(turn[1], content(turn[2], "input_text")))
        else:
            items.append({"role": turn[0], "content": content(turn[1], "input_text")})
    tools: list[dict[str, Any]] = [{"type": "web_search"}]
    for ns, name, desc, strict in c["tools"]:
        fn = {"type": "function", "name": name, "description": desc,
              "parameters": {"type": "object", "properties": {"x": {"type": "string"}}},
              **({"strict": True} if strict else {})}
        if ns:
            tools.append({"type": "namespace", "name": ns, "description": "", "tools": [fn]})
        else:
            tools.append(fn)
    choice = c["choice"]
    if choice == "named":
        ns, name = c["tools"][0][:2]
        choice = {"type": "function", "name": name, **({"namespace": ns} if ns else {})}
    return json.dumps({
        "model": "m", "input": items, "tools": tools, "tool_choice": choice,
        "parallel_tool_calls": c["parallel"], "max_output_tokens": c["max"],
        "temperature": c["temperature"], "store": False,
        **({"instructions": c["system"]} if c["system"] else {}),
        **({} if c["think"] else {"reasoning": {"effort": "none"}})}).encode()


def _same(req: m.GenerateRequest) -> m.GenerateRequest:
    return msgspec.structs.replace(req, req_id="")


@settings(max_examples=300, deadline=None)
@given(conversations())
def test_one_conversation_is_one_request_on_chat_completions_and_responses(c):
    [chat], opts = parse_chat(as_chat(c), LIMITS)
    p = parse_responses(as_responses(c), LIMITS)
    assert _same(p.req) == _same(chat)
    assert p.tools == opts["tools"]
