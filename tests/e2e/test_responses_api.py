"""OpenAI's Responses API (POST /v1/responses, GET and DELETE /v1/responses/{id}), driven by the
official `openai` package, unmodified, on the random-weight built-in: streamed and whole replies
agree and agree with chat completions on the same conversation, forced tool calls validate,
text.format json_schema holds, reasoning comes back as items a later request may send back,
previous_response_id continues a stored conversation through the prefix cache, and errors come
in OpenAI's shape."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any

import jsonschema
import openai
import pytest

from actors.tokenizer.chat_output import unsign
from tests.support.schemas import TIME, WEATHER

pytestmark = pytest.mark.slow

MODEL = "qwen3-tiny"
ASK = "What is the weather in Oslo for 3 days?"
TOOLS = [{"type": "function", "name": "get_weather", "description": "Forecast",
          "parameters": WEATHER, "strict": True},
         {"type": "namespace", "name": "clock", "description": "Time",
          "tools": [{"type": "function", "name": "get_time", "parameters": TIME}]}]
THINK = {"ebnf": 'start: <think> "Rain is likely." </think> "\\n\\nUmbrella."'}
TERMINAL = {"response.completed", "response.incomplete", "response.failed"}


@pytest.fixture(scope="module")
def api(graph):
    return openai.OpenAI(base_url=graph.http + "/v1", api_key="unused", max_retries=0)


def _create(api, **kw: Any):
    return api.responses.create(model=MODEL, **{"temperature": 0, **kw})


def _events(api, **kw: Any) -> list:
    events = list(_create(api, stream=True, **kw))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    return events


def _shape(events: list) -> list[str]:
    """The events' types, runs of one delta type as one: the stream's grammar."""
    out: list[str] = []
    for e in events:
        if not (e.type.endswith(".delta") and out and out[-1] == e.type):
            out.append(e.type)
    return out


def _delta(events: list, kind: str) -> str:
    return "".join(e.delta for e in events if e.type == kind)


def _post(graph, path: str, data: bytes) -> tuple[int, dict]:
    req = urllib.request.Request(graph.http + path, data=data,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _openai_error(body: dict, status: int) -> dict:
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["code"] == status
    return body["error"]


# -- replies --------------------------------------------------------------------------------

def test_a_streamed_reply_is_the_whole_reply_in_order(api):
    kw = dict(input=ASK, instructions="Be terse.", max_output_tokens=24)
    whole = _create(api, **kw)
    [message] = whole.output
    assert message.type == "message" and message.role == "assistant"
    text = whole.output_text
    assert text and message.content[0].type == "output_text"
    assert whole.usage.output_tokens <= 24 and whole.usage.input_tokens > 0
    assert whole.instructions == "Be terse." and whole.max_output_tokens == 24

    events = _events(api, **kw)
    end = "response.incomplete" if whole.status == "incomplete" else "response.completed"
    assert _shape(events) == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.content_part.added", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        end]
    assert _delta(events, "response.output_text.delta") == text
    final = events[-1].response
    assert final.output_text == text and final.status == whole.status
    assert final.usage.output_tokens == whole.usage.output_tokens
    added, done = events[2].item, events[-2].item
    assert added.id == done.id == final.output[0].id and done.content[0].text == text
    assert {e.item_id for e in events[3:-2]} == {added.id}


def test_instructions_are_a_system_message_on_chat_completions(api):
    r = _create(api, instructions="You are terse.", input=ASK, max_output_tokens=16)
    chat = api.chat.completions.create(
        model=MODEL, messages=[{"role": "system", "content": "You are terse."},
                               {"role": "user", "content": ASK}], max_tokens=16, temperature=0)
    assert r.usage.input_tokens == chat.usage.prompt_tokens
    assert r.output_text == chat.choices[0].message.content
    assert r.usage.output_tokens == chat.usage.completion_tokens


def test_a_function_call_and_its_output_are_the_chat_completions_tool_turn(api):
    args = '{"city": "Oslo", "days": 3}'
    r = _create(api, tools=TOOLS, max_output_tokens=16, input=[
        {"role": "developer", "content": "Use the tools."},
        {"role": "user", "content": ASK},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather",
         "arguments": args},
        {"type": "function_call_output", "call_id": "call_1", "output": '{"rain": true}'},
        {"type": "function_call", "call_id": "call_2", "namespace": "clock",
         "name": "get_time", "arguments": '{"zone": "CET"}'},
        {"type": "function_call_output", "call_id": "call_2", "output": "12:00"}])
    chat_tools = [{"type": "function", "function": {
        "name": "get_weather", "description": "Forecast", "parameters": WEATHER,
        "strict": True}}, {"type": "function", "function": {"name": "clock.get_time",
                                                            "parameters": TIME}}]
    chat = api.chat.completions.create(model=MODEL, tools=chat_tools, max_tokens=16,
                                       temperature=0, messages=[
        {"role": "system", "content": "Use the tools."}, {"role": "user", "content": ASK},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": args}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"rain": true}'},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_2", "type": "function",
             "function": {"name": "clock.get_time", "arguments": '{"zone": "CET"}'}}]},
        {"role": "tool", "tool_call_id": "call_2", "content": "12:00"}])
    assert r.usage.input_tokens == chat.usage.prompt_tokens
    message = chat.choices[0].message
    assert r.output_text == (message.content or "")
    shown = [(i.namespace + "." if i.namespace else "") + i.name
             for i in r.output if i.type == "function_call"]
    assert shown == [c.function.name for c in message.tool_calls or []]


@pytest.mark.parametrize("choice,schema", [
    ({"type": "function", "name": "get_weather"}, WEATHER),
    ({"type": "function", "namespace": "clock", "name": "get_time"}, TIME)])
def test_a_forced_call_is_valid_and_streams_into_the_same_item(api, choice, schema):
    kw = dict(input=ASK, tools=TOOLS, tool_choice=choice, parallel_tool_calls=False,
              max_output_tokens=120)
    r = _create(api, **kw)
    assert r.status == "completed"
    [call] = r.output
    assert call.type == "function_call" and call.status == "completed"
    assert (call.name, call.namespace) == (choice["name"], choice.get("namespace"))
    assert call.call_id.startswith("call_") and call.id != call.call_id
    jsonschema.validate(json.loads(call.arguments), schema)
    events = _events(api, **kw)
    assert _shape(events) == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.function_call_arguments.delta", "response.function_call_arguments.done",
        "response.output_item.done", "response.completed"]
    assert _delta(events, "response.function_call_arguments.delta") == call.arguments
    assert events[-3].arguments == call.arguments and events[-3].name == choice["name"]
    done = events[-2].item
    assert (done.name, done.namespace, done.arguments) == (call.name, call.namespace,
                                                           call.arguments)


def test_text_format_json_schema_holds(api):
    schema = {"type": "object", "properties": {
        "city": {"enum": ["Paris", "Oslo"]}, "rain": {"type": "boolean"},
        "days": {"type": "integer", "minimum": 1, "maximum": 7}},
        "required": ["city", "rain", "days"], "additionalProperties": False}
    fmt = {"format": {"type": "json_schema", "name": "forecast", "schema": schema,
                      "strict": True}}
    r = _create(api, input=ASK, text=fmt, max_output_tokens=200)
    assert r.status == "completed" and r.text.format.type == "json_schema"
    jsonschema.validate(json.loads(r.output_text), schema)
    # Any object: the random model's runs on, but it is one.
    r = _create(api, input=ASK, text={"format": {"type": "json_object"}}, max_output_tokens=8)
    assert r.output_text.startswith("{") and r.text.format.type == "json_object"
    assert not _create(api, input=ASK, max_output_tokens=8).output_text.startswith("{")


# -- reasoning ------------------------------------------------------------------------------

def test_reasoning_is_an_item_sealed_when_asked_and_may_be_sent_back(api):
    kw = dict(input=ASK, max_output_tokens=20, include=["reasoning.encrypted_content"],
              extra_body=THINK)
    r = _create(api, **kw)
    reasoning, message = r.output
    assert reasoning.type == "reasoning" and message.type == "message"
    assert [c.text for c in reasoning.content] == ["Rain is likely."]
    assert unsign(reasoning.encrypted_content) == "Rain is likely."
    assert r.output_text == "Umbrella." and r.status == "completed"

    events = _events(api, **kw)
    assert _shape(events) == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.content_part.added",
        "response.reasoning_text.delta", "response.reasoning_text.done",
        "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.done",
        "response.content_part.done", "response.output_item.done", "response.completed"]
    assert _delta(events, "response.reasoning_text.delta") == "Rain is likely."
    assert _delta(events, "response.output_text.delta") == "Umbrella."
    sealed = [e.item for e in events if e.type == "response.output_item.done"][0]
    assert unsign(sealed.encrypted_content) == "Rain is likely."
    assert _create(api, input=ASK, max_output_tokens=20, extra_body=THINK) \
        .output[0].encrypted_content is None

    # Sent back as the client got it, or sealed only (its text stripped, as Codex sends it).
    items = [i.model_dump(exclude_none=True) for i in r.output]
    bare = {k: v for k, v in items[0].items() if k != "content"}
    prompts = set()
    for turn in (items, [bare, items[1]]):
        again = _create(api, max_output_tokens=4, input=[
            {"role": "user", "content": ASK}, *turn, {"role": "user", "content": "And Lima?"}])
        assert again.status in ("completed", "incomplete")
        prompts.add(again.usage.input_tokens)
    assert len(prompts) == 1 and prompts.pop() > r.usage.input_tokens


def test_reasoning_effort_none_turns_thinking_off_in_the_template(api):
    on = _create(api, input=ASK, max_output_tokens=1)
    off = _create(api, input=ASK, max_output_tokens=1, reasoning={"effort": "none"})
    # The template closes an empty think block: <think>\n\n</think>\n\n.
    assert off.usage.input_tokens == on.usage.input_tokens + 4


# -- the store ------------------------------------------------------------------------------

def test_previous_response_id_continues_the_conversation_from_the_cache(api):
    rules = "Answer as a weather station would, in one line."  # no other test's prefix
    first = _create(api, instructions=rules, input=ASK, max_output_tokens=16)
    second = _create(api, instructions=rules, previous_response_id=first.id,
                     input="And in Lima?", max_output_tokens=16)
    assert second.previous_response_id == first.id
    assert second.usage.input_tokens_details.cached_tokens > 0
    # Its prompt is the whole conversation, sent as items.
    items = [{"role": "user", "content": ASK},
             *[i.model_dump(exclude_none=True) for i in first.output],
             {"role": "user", "content": "And in Lima?"}]
    whole = _create(api, instructions=rules, input=items, max_output_tokens=16, store=False)
    assert second.usage.input_tokens == whole.usage.input_tokens
    # The instructions are not carried: a continuation without them is shorter by them.
    bare = _create(api, previous_response_id=first.id, input="And in Lima?",
                   max_output_tokens=1, store=False)
    assert bare.usage.input_tokens < second.usage.input_tokens
    # A chain: the third continues the second, which continued the first.
    third = _create(api, previous_response_id=second.id, input="Thanks.", max_output_tokens=1,
                    instructions=rules)
    assert third.usage.input_tokens > second.usage.input_tokens + second.usage.output_tokens


def test_a_stored_response_is_retrieved_then_deleted(api):
    r = _create(api, input=ASK, max_output_tokens=8)
    got = api.responses.retrieve(r.id)
    assert got.id == r.id and got.output_text == r.output_text and got.status == r.status
    assert got.usage.output_tokens == r.usage.output_tokens
    api.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError) as e:
        api.responses.retrieve(r.id)
    assert e.value.status_code == 404 and r.id in e.value.body["message"]
    with pytest.raises(openai.NotFoundError):
        api.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError):
        _create(api, previous_response_id=r.id, input="More.", max_output_tokens=1)


def test_a_streamed_response_is_stored_too(api):
    events = _events(api, input=ASK, max_output_tokens=8)
    final = events[-1].response
    got = api.responses.retrieve(final.id)
    assert got.output_text == final.output_text and got.status == final.status


def test_store_false_is_not_kept(api):
    r = _create(api, input=ASK, max_output_tokens=4, store=False)
    assert r.store is False
    with pytest.raises(openai.NotFoundError):
        api.responses.retrieve(r.id)
    with pytest.raises(openai.NotFoundError) as e:
        _create(api, previous_response_id=r.id, input="More.", max_output_tokens=1)
    assert e.value.body["param"] == "previous_response_id"


def test_an_unknown_previous_response_id_is_a_404(graph):
    status, body = _post(graph, "/v1/responses", json.dumps(
        {"model": MODEL, "input": "Hi", "previous_response_id": "resp_nope"}).encode())
    error = _openai_error(body, 404)
    assert status == 404 and error["type"] == "not_found_error"
    assert "resp_nope" in error["message"] and error["param"] == "previous_response_id"


# -- limits and errors ----------------------------------------------------------------------

def test_max_output_tokens_ends_the_reply_incomplete(api):
    kw = dict(input=ASK, max_output_tokens=2,
              extra_body={"ebnf": 'start: "Umbrella, umbrella, umbrella, umbrella."'})
    r = _create(api, **kw)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 2 and "Umbrella, umbrella".startswith(r.output_text)
    events = _events(api, **kw)
    assert events[-1].type == "response.incomplete"
    assert events[-1].response.incomplete_details.reason == "max_output_tokens"
    assert _delta(events, "response.output_text.delta") == r.output_text


def test_malformed_json_is_a_400_in_openais_shape(graph):
    status, body = _post(graph, "/v1/responses", b'{"input": "Hi"')
    error = _openai_error(body, 400)
    assert status == 400 and error["type"] == "invalid_request_error"
    assert "malformed" in error["message"]


def test_an_image_is_a_400_naming_where_it_is(api):
    with pytest.raises(openai.BadRequestError) as e:
        _create(api, max_output_tokens=4, input=[{"role": "user", "content": [
            {"type": "input_text", "text": "What is this?"},
            {"type": "input_image", "image_url": "data:image/png;base64,AAAA"}]}])
    assert e.value.status_code == 400 and e.value.body["param"] == "input"
    assert "input[0].content[1]: input_image" in e.value.body["message"]


def test_a_prompt_over_the_context_is_a_400_naming_the_lengths(api):
    with pytest.raises(openai.BadRequestError) as e:
        _create(api, input="word " * 41_000, max_output_tokens=4)
    message = e.value.body["message"]
    assert "the model's context is 40960 tokens" in message, message
    assert int(message.split("prompt has ")[1].split()[0]) > 40960


def test_hosted_tools_are_accepted_and_not_shown(api):
    r = _create(api, input=ASK, max_output_tokens=4,
                tools=[{"type": "web_search"}, {"type": "code_interpreter",
                                                "container": {"type": "auto"}}])
    plain = _create(api, input=ASK, max_output_tokens=4)
    assert r.usage.input_tokens == plain.usage.input_tokens
    assert [t.type for t in r.tools] == ["web_search", "code_interpreter"]


def test_background_is_a_400(api):
    with pytest.raises(openai.BadRequestError) as e:
        _create(api, input=ASK, background=True)
    assert e.value.body["param"] == "background"
