"""Tool calls and reasoning through the OpenAI chat API, with the official `openai` client, on
the random-weight built-in: `required` and a named function always give a valid call (the
grammar forces it), streamed deltas assemble into the non-streamed call, a two-turn tool
conversation runs, and <think> text comes back as reasoning_content."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from tests.support.schemas import TIME, WEATHER

pytestmark = pytest.mark.slow

MODEL = "qwen3-tiny"
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Forecast",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": TIME}}]
ASK = [{"role": "user", "content": "What is the weather in Oslo for 3 days?"}]


@pytest.fixture(scope="module")
def api(graph):
    return openai.OpenAI(base_url=graph.http + "/v1", api_key="unused", max_retries=0)


def _streamed_calls(chunks):
    calls, reasons = {}, []
    for c in chunks:
        if not c.choices:
            continue
        reasons.append(c.choices[0].finish_reason)
        for d in c.choices[0].delta.tool_calls or []:
            entry = calls.setdefault(d.index, {"name": "", "arguments": ""})
            if d.function.name:
                entry["name"] = d.function.name
            entry["arguments"] += d.function.arguments or ""
    return [calls[i] for i in sorted(calls)], [r for r in reasons if r]


@pytest.mark.parametrize("choice", ["required", "get_time"])
def test_a_forced_call_is_valid_and_streams_into_the_same_call(api, choice):
    tool_choice = choice if choice == "required" else \
        {"type": "function", "function": {"name": choice}}
    kw = dict(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=tool_choice, max_tokens=120,
              temperature=0, parallel_tool_calls=False)
    r = api.chat.completions.create(**kw)
    assert r.choices[0].finish_reason == "tool_calls"
    (call,) = r.choices[0].message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    schema = {"get_weather": WEATHER, "get_time": TIME}[call.function.name]
    jsonschema.validate(json.loads(call.function.arguments), schema)
    if choice != "required":
        assert call.function.name == choice
    streamed, reasons = _streamed_calls(api.chat.completions.create(**kw, stream=True))
    assert streamed == [{"name": call.function.name, "arguments": call.function.arguments}]
    assert reasons == ["tool_calls"]


def test_a_two_turn_tool_conversation(api):
    first = api.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS,
                                        tool_choice="required", max_tokens=120, temperature=0,
                                        parallel_tool_calls=False)
    call = first.choices[0].message.tool_calls[0]
    turn = ASK + [first.choices[0].message.model_dump(exclude_none=True),
                  {"role": "tool", "tool_call_id": call.id, "content": '{"forecast": "sun"}'}]
    whole = api.chat.completions.create(model=MODEL, messages=turn, tools=TOOLS, max_tokens=16,
                                        temperature=0)
    chunks = list(api.chat.completions.create(model=MODEL, messages=turn, tools=TOOLS,
                                              max_tokens=16, temperature=0, stream=True))
    # The call and its result are in the second prompt, which is longer by them.
    assert whole.usage.prompt_tokens > first.usage.prompt_tokens + 10
    message = whole.choices[0].message
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == (message.content or "")
    assert _streamed_calls(chunks)[0] == [{"name": c.function.name,
                                           "arguments": c.function.arguments}
                                          for c in message.tool_calls or []]
    none = api.chat.completions.create(model=MODEL, messages=turn, tools=TOOLS,
                                       tool_choice="none", max_tokens=16, temperature=0)
    assert none.choices[0].message.tool_calls is None


def test_bad_tool_requests_are_400s_naming_the_field(api):
    for kw, field in [
        (dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}),
         "tool_choice"),
        (dict(tool_choice="required"), "tool_choice"),
        (dict(tools=TOOLS, tool_choice="required", response_format={"type": "json_object"}),
         "tool_choice"),
        (dict(tools=[{"type": "retrieval", "function": {"name": "x"}}]), "tools"),
    ]:
        with pytest.raises(openai.BadRequestError, match=field):
            api.chat.completions.create(model=MODEL, messages=ASK, max_tokens=4, **kw)


def test_think_text_is_reasoning_content_streamed_and_not(api):
    """The grammar makes the random model think, then answer."""
    kw = dict(model=MODEL, messages=ASK, max_tokens=20, temperature=0,
              extra_body={"ebnf": 'start: <think> "Rain is likely." </think> "\\n\\nUmbrella."'})
    r = api.chat.completions.create(**kw)
    message = r.choices[0].message
    assert message.reasoning_content == "Rain is likely." and message.content == "Umbrella."
    chunks = [c for c in api.chat.completions.create(**kw, stream=True) if c.choices]
    thought = "".join(getattr(c.choices[0].delta, "reasoning_content", None) or ""
                      for c in chunks)
    assert thought == "Rain is likely."
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == "Umbrella."
    # enable_thinking=False closes an empty think block in the prompt: a longer prompt.
    off = api.chat.completions.create(model=MODEL, messages=ASK, max_tokens=1,
                                      extra_body={"chat_template_kwargs":
                                                  {"enable_thinking": False}})
    assert off.usage.prompt_tokens == r.usage.prompt_tokens + 4
