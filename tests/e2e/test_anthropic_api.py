"""Anthropic's Messages API (POST /v1/messages, /v1/messages/count_tokens), driven by the official
`anthropic` package, unmodified, on the random-weight built-in: streamed and whole replies agree
and agree with chat completions on the same conversation, forced tool use validates, thinking
comes back as signed blocks a later turn may send back, usage counts the prompt as count_tokens
does and the cache apart, stop sequences, and errors in Anthropic's shape."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any

import anthropic
import jsonschema
import openai
import pytest

from actors.tokenizer.chat_output import unsign
from tests.support.schemas import TIME, WEATHER

pytestmark = pytest.mark.slow

MODEL = "qwen3-tiny"
GREEDY = {"temperature": 0}  # the SDK takes temperature no more: it goes in the body
TOOLS = [{"name": "get_weather", "description": "Forecast", "input_schema": WEATHER},
         {"name": "get_time", "input_schema": TIME}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
ASK = [{"role": "user", "content": "What is the weather in Oslo for 3 days?"}]
THINK = {"ebnf": 'start: <think> "Rain is likely." </think> "\\n\\nUmbrella."'}


@pytest.fixture(scope="module")
def claude(graph):
    return anthropic.Anthropic(base_url=graph.http, api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def api(graph):
    return openai.OpenAI(base_url=graph.http + "/v1", api_key="unused", max_retries=0)


def _text(message) -> str:
    return "".join(b.text for b in message.content if b.type == "text")


def _check_order(events) -> None:
    """The SDK's raw events (it drops ping) in Anthropic's order: message_start, blocks opened,
    filled and stopped one at a time with indices 0, 1, 2..., then message_delta and
    message_stop."""
    types = [e.type for e in events]
    assert types[0] == "message_start" and types[-2:] == ["message_delta", "message_stop"]
    open_at, index = None, 0
    for e in events[1:-2]:
        if e.type == "content_block_start":
            assert open_at is None and e.index == index
            open_at, index = index, index + 1
        else:
            assert e.type in ("content_block_delta", "content_block_stop") and e.index == open_at
            if e.type == "content_block_stop":
                open_at = None
    assert open_at is None


def _post(graph, path: str, body: bytes | dict, headers: dict[str, str] | None = None
          ) -> tuple[int, Any]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(graph.http + path, data=data, method="POST", headers={
        "content-type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _is_error(body: Any, kind: str = "invalid_request_error") -> str:
    """Anthropic's error body; its message."""
    assert body["type"] == "error" and set(body["error"]) == {"type", "message"}
    assert body["error"]["type"] == kind
    return body["error"]["message"]


# -- replies ---------------------------------------------------------------------------------------

def test_streamed_and_whole_replies_agree(claude):
    kw = dict(model="claude-haiku-test", max_tokens=24, system="Be brief.",
              messages=[{"role": "user", "content": "Hello there"}], extra_body=GREEDY)
    whole = claude.messages.create(**kw)
    assert whole.type == "message" and whole.role == "assistant" and whole.model == MODEL
    assert whole.id.startswith("msg_") and whole.stop_reason == "max_tokens"
    assert whole.usage.output_tokens == 24 and _text(whole)
    events = list(claude.messages.create(**kw, stream=True))
    _check_order(events)
    assert "".join(e.delta.text for e in events if e.type == "content_block_delta") == \
        _text(whole)
    assert events[-2].delta.stop_reason == "max_tokens" and events[-2].usage.output_tokens == 24
    with claude.messages.stream(**kw) as s:
        final = s.get_final_message()
    assert [(b.type, b.text) for b in final.content] == \
        [(b.type, b.text) for b in whole.content]
    assert (final.stop_reason, final.usage.output_tokens) == ("max_tokens", 24)


CALLED = ASK + [
    {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_01", "name": "get_weather",
                                       "input": {"city": "Oslo", "days": 3}}]},
    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_01",
                                  "content": '{"forecast": "sun"}'}]}]


@pytest.mark.parametrize("case", ["system", "tool result"])
def test_the_same_greedy_reply_as_chat_completions(claude, api, case):
    if case == "system":
        turns, chat, tools = ASK, [{"role": "system", "content": "Be brief."}] + ASK, {}
        system = {"system": "Be brief."}
    else:
        turns, system = CALLED, {}
        chat = ASK + [{"role": "assistant", "content": None, "tool_calls": [
            {"id": "toolu_01", "type": "function", "function": {
                "name": "get_weather", "arguments": '{"city": "Oslo", "days": 3}'}}]},
                      {"role": "tool", "tool_call_id": "toolu_01",
                       "content": '{"forecast": "sun"}'}]
        tools = {"tools": [{"type": "function", "function": {
            "name": t["name"], "description": t.get("description"),
            "parameters": t["input_schema"]}} for t in TOOLS]}
    message = claude.messages.create(model=MODEL, max_tokens=20, messages=turns, **system,
                                     **({"tools": TOOLS} if tools else {}), extra_body=GREEDY)
    reply = api.chat.completions.create(model=MODEL, max_tokens=20, temperature=0,
                                        messages=chat, **tools)
    assert _text(message) and _text(message) == reply.choices[0].message.content
    assert message.usage.input_tokens + message.usage.cache_read_input_tokens == \
        reply.usage.prompt_tokens
    assert message.usage.output_tokens == reply.usage.completion_tokens


# -- tools -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("choice", [{"type": "tool", "name": "get_time"},
                                    {"type": "any", "disable_parallel_tool_use": True}])
def test_forced_tool_use_validates_streamed_and_not(claude, choice):
    kw = dict(model=MODEL, max_tokens=120, messages=ASK, tools=TOOLS, tool_choice=choice,
              extra_body=GREEDY)
    message = claude.messages.create(**kw)
    assert message.stop_reason == "tool_use"
    (call,) = message.content
    assert call.type == "tool_use" and call.id.startswith("toolu_")
    jsonschema.validate(call.input, SCHEMAS[call.name])
    if choice["type"] == "tool":
        assert call.name == "get_time"
    events = list(claude.messages.create(**kw, stream=True))
    _check_order(events)
    (start,) = [e for e in events if e.type == "content_block_start"]
    assert (start.content_block.type, start.content_block.name) == ("tool_use", call.name)
    pieces = [e.delta.partial_json for e in events if e.type == "content_block_delta"]
    assert all(e.delta.type == "input_json_delta" for e in events
               if e.type == "content_block_delta")
    assert json.loads("".join(pieces)) == call.input
    assert events[-2].delta.stop_reason == "tool_use"


def test_a_tool_result_turn_is_served(claude):
    first = claude.messages.create(model=MODEL, max_tokens=120, messages=ASK, tools=TOOLS,
                                   tool_choice={"type": "any"}, extra_body=GREEDY)
    calls = [b for b in first.content if b.type == "tool_use"]
    turns = ASK + [{"role": "assistant", "content": [b.model_dump() for b in first.content]},
                   {"role": "user", "content": [
                       {"type": "tool_result", "tool_use_id": c.id, "content": "sunny, 21 C"}
                       for c in calls]}]
    second = claude.messages.create(model=MODEL, max_tokens=16, messages=turns, tools=TOOLS,
                                    extra_body=GREEDY)
    assert second.stop_reason in ("end_turn", "max_tokens", "tool_use")
    before = first.usage.input_tokens + first.usage.cache_read_input_tokens
    after = second.usage.input_tokens + second.usage.cache_read_input_tokens
    assert after > before + first.usage.output_tokens  # the call and its result are in it
    count = claude.messages.count_tokens(model=MODEL, messages=turns, tools=TOOLS)
    assert count.input_tokens == after
    assert second.usage.cache_read_input_tokens >= before  # the first prompt, cached


# -- thinking --------------------------------------------------------------------------------------

def test_thinking_blocks_streamed_and_not_are_signed_and_go_back(claude):
    kw = dict(model=MODEL, max_tokens=20, messages=ASK, extra_body={**GREEDY, **THINK})
    message = claude.messages.create(**kw)
    thinking, text = message.content
    assert (thinking.type, thinking.thinking) == ("thinking", "Rain is likely.")
    assert unsign(thinking.signature) == "Rain is likely."
    assert (text.type, text.text, message.stop_reason) == ("text", "Umbrella.", "end_turn")
    events = list(claude.messages.create(**kw, stream=True))
    _check_order(events)
    deltas = [e.delta.type for e in events if e.type == "content_block_delta" and e.index == 0]
    assert deltas[-1] == "signature_delta" and set(deltas) == {"thinking_delta",
                                                               "signature_delta"}
    with claude.messages.stream(**kw) as s:
        final = s.get_final_message()
    assert [b.model_dump(exclude_none=True) for b in final.content] == \
        [b.model_dump(exclude_none=True) for b in message.content]
    # The block sent back in the next turn, whole and with its text omitted: one prompt.
    later = [{"role": "user", "content": "And tomorrow?"}]
    whole = ASK + [{"role": "assistant", "content": [b.model_dump() for b in message.content]}]
    omitted = ASK + [{"role": "assistant", "content": [
        {"type": "thinking", "thinking": "", "signature": thinking.signature},
        {"type": "text", "text": "Umbrella."}]}]
    served = claude.messages.create(model=MODEL, max_tokens=4, messages=whole + later,
                                    extra_body=GREEDY)
    assert served.usage.output_tokens == 4
    counts = [claude.messages.count_tokens(model=MODEL, messages=turns + later).input_tokens
              for turns in (whole, omitted)]
    assert counts[0] == counts[1] == served.usage.input_tokens + \
        served.usage.cache_read_input_tokens


def test_thinking_display_omitted_sends_the_signature_alone(claude):
    message = claude.messages.create(
        model=MODEL, max_tokens=20, messages=ASK, extra_body={**GREEDY, **THINK},
        thinking={"type": "enabled", "budget_tokens": 1024, "display": "omitted"})
    thinking, text = message.content
    assert thinking.thinking == "" and unsign(thinking.signature) == "Rain is likely."
    assert text.text == "Umbrella."


def test_thinking_disabled_closes_an_empty_think_block_in_the_prompt(claude):
    kw = dict(model=MODEL, messages=ASK)
    on = claude.messages.count_tokens(**kw).input_tokens
    off = claude.messages.count_tokens(**kw, thinking={"type": "disabled"}).input_tokens
    assert off == on + 4  # <think>\n\n</think>\n\n
    message = claude.messages.create(**kw, max_tokens=2, thinking={"type": "disabled"},
                                     extra_body=GREEDY)
    assert message.usage.input_tokens + message.usage.cache_read_input_tokens == off


def test_a_last_assistant_turn_is_the_start_of_the_reply(graph, claude):
    """Anthropic's prefill: the prompt is the open assistant turn and the prefill's text, and
    the reply is what comes after it (as the greedy reply to the shorter prompt goes on)."""
    prefill = [*ASK, {"role": "assistant", "content": "The weather"}]
    status, body = _post(graph, "/tokenize", {"prompt": "The weather"})
    assert status == 200
    asked = claude.messages.count_tokens(model=MODEL, messages=ASK).input_tokens
    count = claude.messages.count_tokens(model=MODEL, messages=prefill).input_tokens
    assert count == asked + json.loads(body)["count"]
    message = claude.messages.create(model=MODEL, max_tokens=6, messages=prefill,
                                     extra_body=GREEDY)
    assert message.usage.input_tokens + message.usage.cache_read_input_tokens == count


# -- usage, cache, stop sequences ------------------------------------------------------------------

def test_usage_counts_the_prompt_as_count_tokens_and_a_repeat_reads_the_cache(claude):
    kw = dict(model=MODEL, system=[{"type": "text", "text": "You count sheep. " * 20}],
              messages=[{"role": "user", "content": "How many sheep so far, exactly?"}],
              tools=TOOLS)
    count = claude.messages.count_tokens(**kw).input_tokens
    first = claude.messages.create(**kw, max_tokens=3, extra_body=GREEDY)
    again = claude.messages.create(**kw, max_tokens=3, extra_body=GREEDY)
    for message in (first, again):
        usage = message.usage
        assert usage.input_tokens + usage.cache_read_input_tokens == count
        assert usage.cache_creation_input_tokens == 0 and usage.output_tokens == 3
    assert again.usage.cache_read_input_tokens > first.usage.cache_read_input_tokens
    assert again.usage.input_tokens >= 1  # the last prompt token is computed, not read
    # streamed: message_start has the prompt, message_delta the split the SDK keeps
    with claude.messages.stream(**kw, max_tokens=3, extra_body=GREEDY) as s:
        final = s.get_final_message()
    assert (final.usage.input_tokens, final.usage.cache_read_input_tokens) == \
        (again.usage.input_tokens, again.usage.cache_read_input_tokens)


def test_a_stop_sequence_ends_the_reply_before_it(claude):
    kw = dict(model=MODEL, max_tokens=24, messages=[{"role": "user", "content": "Go on"}])
    full = _text(claude.messages.create(**kw, extra_body=GREEDY))
    words = full.split()
    assert len(words) >= 3, full
    stop = words[len(words) // 2]
    before = full[:full.index(stop)]
    message = claude.messages.create(**kw, stop_sequences=[stop], extra_body=GREEDY)
    assert (message.stop_reason, message.stop_sequence) == ("stop_sequence", stop)
    assert _text(message) == before
    events = list(claude.messages.create(**kw, stop_sequences=[stop], stream=True,
                                         extra_body=GREEDY))
    delta = events[-2].delta
    assert (delta.stop_reason, delta.stop_sequence) == ("stop_sequence", stop)


# -- errors and headers ----------------------------------------------------------------------------

def test_errors_are_in_anthropics_shape(graph):
    user = [{"role": "user", "content": "Hi"}]
    status, body = _post(graph, "/v1/messages", {"model": MODEL, "messages": user})
    assert status == 400 and "max_tokens" in _is_error(body)
    status, body = _post(graph, "/v1/messages", b'{"model": "x", "max_tokens": 4, "messa')
    assert status == 400 and _is_error(body).startswith("malformed request")
    image = [{"role": "user", "content": [
        {"type": "text", "text": "What is this?"},
        {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                     "data": "iVBORw0KGgo="}}]}]
    for path in ("/v1/messages", "/v1/messages/count_tokens"):
        status, body = _post(graph, path, {"model": MODEL, "max_tokens": 4, "messages": image})
        assert status == 400 and _is_error(body).startswith("messages[0].content[1]: image")
    status, body = _post(graph, "/v1/messages", {"model": MODEL, "max_tokens": 4,
                                                 "temperature": 1.5, "messages": user})
    assert status == 400 and "temperature" in _is_error(body)


def test_a_prompt_over_the_context_is_refused_naming_the_lengths(graph, claude):
    turns = [{"role": "user", "content": "hello " * 41000}]
    status, body = _post(graph, "/v1/messages", {"model": MODEL, "max_tokens": 4,
                                                 "messages": turns, "stream": True})
    message = _is_error(body)
    count = claude.messages.count_tokens(model=MODEL, messages=turns).input_tokens
    assert status == 400 and count > 40960
    assert f"prompt has {count} tokens" in message and "context is 40960 tokens" in message


def test_the_sdk_raises_its_own_error_types(claude):
    with pytest.raises(anthropic.BadRequestError) as e:
        claude.messages.create(model=MODEL, max_tokens=4, messages=ASK, tools=TOOLS,
                               tool_choice={"type": "tool", "name": "nope"})
    assert e.value.status_code == 400 and "no tool 'nope'" in _is_error(e.value.body)


def test_beta_query_and_anthropic_headers_are_accepted(graph, claude):
    kw = dict(model=MODEL, max_tokens=8, messages=ASK, extra_body=GREEDY)
    plain = claude.messages.create(**kw)
    beta = claude.beta.messages.create(  # POST /v1/messages?beta=true, anthropic-beta header
        **kw, betas=["interleaved-thinking-2025-05-14", "context-management-2025-06-27"])
    assert _text(beta) == _text(plain)
    counted = claude.beta.messages.count_tokens(model=MODEL, messages=ASK,
                                                betas=["token-counting-2024-11-01"])
    assert counted.input_tokens == plain.usage.input_tokens + \
        plain.usage.cache_read_input_tokens
    raw = {"model": MODEL, "max_tokens": 8, "messages": ASK, **GREEDY}
    status, body = _post(graph, "/v1/messages?beta=true", raw,
                         headers={"anthropic-version": "2023-06-01",
                                  "anthropic-beta": "fine-grained-tool-streaming-2025-05-14",
                                  "x-claude-code-session-id": "s-1"})
    assert status == 200 and json.loads(body)["content"][0]["text"] == _text(plain)
