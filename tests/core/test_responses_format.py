"""OpenAI Responses bodies as requests (actors/tokenizer/responses_format.py): input items merged
into chat turns, developer and instructions as system, namespaced and hosted tools, tool_choice,
text.format, previous_response_id, and the errors, each naming the field. The property the
module exists for (one conversation, one request, whichever API sends it):
test_responses_as_chat.py."""

from __future__ import annotations

import json
from typing import Any

import pytest

from actors.tokenizer.chat_output import sign
from actors.tokenizer.intake import RequestError
from actors.tokenizer.openai_format import ChatMessageBody
from actors.tokenizer.responses_format import (UNBOUNDED, input_messages, parse_responses,
                                               reply_tool_call)
from tests.support.response_items import call, output, said, thought, user
from protocol import messages as m
from protocol.config import LimitsConfig

LIMITS = LimitsConfig()
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
FN = {"type": "function", "name": "get_weather", "description": "Forecast",
      "parameters": WEATHER}
SHELL = {"type": "namespace", "name": "shell", "description": "Run things", "tools": [
    {"type": "function", "name": "exec", "parameters": {"type": "object", "properties": {
        "cmd": {"type": "string"}}}},
    {"type": "function", "name": "kill"}]}


def body(**fields: Any) -> bytes:
    """A /v1/responses body: one user string unless input is given."""
    return json.dumps({"model": "gpt-x", "input": "Hi", **fields}).encode()


def parse(history: dict[str, list[ChatMessageBody]] | None = None, **fields: Any):
    return parse_responses(body(**fields), LIMITS, history=(history or {}).get)


def refused(**fields: Any) -> RequestError:
    with pytest.raises(RequestError) as e:
        parse(**fields)
    return e.value


def turns(req: m.GenerateRequest) -> list[tuple]:
    """Each message as (role, content, reasoning, [(call id, name, arguments)], tool call id,
    name), without the fields it leaves empty."""
    out = []
    for msg in req.messages:
        calls = [(c["id"], c["function"]["name"], c["function"]["arguments"])
                 for c in msg.tool_calls]
        out.append(tuple(x for x in (msg.role, msg.content, msg.reasoning_content, calls,
                                     msg.tool_call_id, msg.name) if x != "" and x != []))
    return out


# -- input items -> turns -------------------------------------------------------------------

def test_a_string_input_is_one_user_message_with_the_defaults():
    p = parse()
    assert turns(p.req) == [("user", "Hi")]
    assert p.req.max_new_tokens == UNBOUNDED and p.req.temperature == 1.0
    assert p.req.top_p == 1.0 and p.req.chat_template_kwargs == {} and not p.tools
    assert p.req.session == "" and p.req.json_schema == p.req.ebnf == ""


def test_a_turns_reasoning_message_and_calls_are_one_assistant_message_and_outputs_tools():
    p = parse(input=[user("Weather?"), thought("Look it up."), said("Checking."),
                     call("c1", "get_weather", '{"city": "Oslo"}'),
                     call("c2", "get_weather", '{"city": "Lima"}'),
                     output("c1", "sun"), output("c2", [{"type": "input_text", "text": "rain"}]),
                     said("Sun in Oslo, rain in Lima.")], tools=[FN])
    assert turns(p.req) == [
        ("user", "Weather?"),
        ("assistant", "Checking.", "Look it up.", [("c1", "get_weather", '{"city": "Oslo"}'),
                                                   ("c2", "get_weather", '{"city": "Lima"}')]),
        ("tool", "sun", "c1", "get_weather"), ("tool", "rain", "c2", "get_weather"),
        ("assistant", "Sun in Oslo, rain in Lima.")]
    assert p.tools


def test_a_message_after_a_turns_calls_or_text_starts_a_new_assistant_message():
    assert turns(parse(input=[user("a"), call("c1", "f"), said("after")]).req) == [
        ("user", "a"), ("assistant", [("c1", "f", "{}")]), ("assistant", "after")]
    assert turns(parse(input=[user("a"), said("one"), thought("two"), said("three")]).req) == [
        ("user", "a"), ("assistant", "one"), ("assistant", "three", "two")]
    # Reasoning alone, then the text and a call: one turn; a user message ends it.
    assert turns(parse(input=[thought("r"), said("t"), call("c", "f"), user("u"),
                              call("d", "f")]).req) == [
        ("assistant", "t", "r", [("c", "f", "{}")]), ("user", "u"),
        ("assistant", [("d", "f", "{}")])]


def test_roles_developer_is_system_and_content_parts_are_joined():
    p = parse(input=[{"role": "developer", "content": "Be terse."},
                     {"role": "system", "content": [{"type": "input_text", "text": "A"},
                                                    {"type": "input_text", "text": "B"}]},
                     {"role": "user", "content": "Hi"},
                     {"role": "assistant", "content": [{"type": "output_text", "text": "x"},
                                                       {"type": "refusal", "refusal": "no"}]}])
    assert turns(p.req) == [("system", "Be terse."), ("system", "AB"), ("user", "Hi"),
                            ("assistant", "xno")]


def test_instructions_come_first_and_are_not_part_of_the_stored_conversation():
    p = parse(instructions="You are terse.", input=[{"role": "developer", "content": "D"},
                                                    user("Hi")])
    assert turns(p.req) == [("system", "You are terse."), ("system", "D"), ("user", "Hi")]
    assert [(c.role, c.content) for c in p.conversation] == [("system", "D"), ("user", "Hi")]


def test_a_tool_output_for_an_unknown_call_has_no_name():
    assert turns(parse(input=[output("elsewhere", "42")]).req) == [("tool", "42", "elsewhere")]


# -- reasoning items ------------------------------------------------------------------------

def _reasoning(item: dict[str, Any]) -> str:
    [msg] = input_messages([item])
    assert msg.role == "assistant" and msg.content == ""
    return msg.reasoning_content or ""


@pytest.mark.parametrize("item,text", [
    ({"content": [{"type": "reasoning_text", "text": "a"}, {"type": "reasoning_text",
                                                            "text": "b"}]}, "ab"),
    ({"summary": [], "encrypted_content": sign("sealed")}, "sealed"),
    ({"summary": [{"type": "summary_text", "text": "gist"}]}, "gist"),
    # Another server's sealed reasoning means nothing here; ours does, over its summary.
    ({"summary": [], "encrypted_content": "gAAAAB-openai-blob"}, ""),
    ({"summary": [{"type": "summary_text", "text": "gist"}],
      "encrypted_content": sign("all of it")}, "all of it"),
    ({"content": [{"type": "reasoning_text", "text": "shown"}],
      "encrypted_content": sign("sealed")}, "shown"),
    ({"content": None, "summary": [], "encrypted_content": None}, ""),
])
def test_a_reasoning_items_text_is_its_content_else_our_sealed_text_else_its_summary(item, text):
    assert _reasoning({"type": "reasoning", "id": "rs_1", **item}) == text


# -- tools ----------------------------------------------------------------------------------

def test_namespaced_functions_are_shown_as_namespace_dot_name_and_map_back():
    p = parse(tools=[FN, SHELL], input=[user("ls"), call("c1", "exec", '{"cmd": "ls"}',
                                                         namespace="shell"),
                                        output("c1", "a.txt")])
    assert [t["function"]["name"] for t in p.req.tools] == ["get_weather", "shell.exec",
                                                            "shell.kill"]
    assert p.req.tools[1]["function"]["parameters"] == SHELL["tools"][0]["parameters"]
    assert p.req.tools[2]["function"]["parameters"] == {"type": "object", "properties": {}}
    assert p.namespaces == {"shell.exec": ("shell", "exec"), "shell.kill": ("shell", "kill")}
    assert turns(p.req)[1:] == [("assistant", [("c1", "shell.exec", '{"cmd": "ls"}')]),
                                ("tool", "a.txt", "c1", "shell.exec")]
    assert reply_tool_call("shell.exec", p.namespaces) == {"name": "exec", "namespace": "shell"}
    assert reply_tool_call("get_weather", p.namespaces) == {"name": "get_weather"}


def test_hosted_and_custom_tools_are_not_shown_and_only_they_is_no_tools():
    hosted = [{"type": "web_search"}, {"type": "file_search", "vector_store_ids": ["vs"]},
              {"type": "code_interpreter", "container": {"type": "auto"}},
              {"type": "custom", "name": "apply_patch", "format": {"type": "grammar"}}]
    p = parse(tools=[*hosted, FN])
    assert [t["function"]["name"] for t in p.req.tools] == ["get_weather"]
    p = parse(tools=hosted)
    assert p.req.tools == [] and not p.tools


@pytest.mark.parametrize("tools,says", [
    ([{"name": "f"}], "tools[0]: a tool needs a type"),
    ([FN, {"type": "function"}], "tools[1]: a function tool needs a name"),
    ([{"type": "function", "name": "f", "parameters": "{}"}], "JSON schema object"),
    ([{"type": "namespace", "tools": [FN]}], "tools[0]: a namespace needs a name"),
    ([{"type": "namespace", "name": "ns", "tools": [{"type": "function"}]}],
     "tools[0].tools[0]: a function tool needs a name"),
])
def test_a_malformed_tool_is_refused_naming_it(tools, says):
    e = refused(tools=tools)
    assert e.code == 400 and e.param == "tools" and says in e.message


@pytest.mark.parametrize("choice,forced", [
    (None, None), ("auto", None), ("none", None), ("required", ["get_weather", "shell.exec",
                                                                "shell.kill"]),
    ({"type": "function", "name": "get_weather"}, ["get_weather"]),
    ({"type": "function", "name": "exec", "namespace": "shell"}, ["shell.exec"]),
    ({"type": "function", "name": "shell.kill"}, ["shell.kill"]),
    ({"type": "allowed_tools", "mode": "auto", "tools": [FN]}, None),
])
def test_tool_choice_forms(choice, forced):
    p = parse(tools=[FN, SHELL], tool_choice=choice, parallel_tool_calls=False)
    assert p.tools == (choice != "none")
    if forced is None:
        assert p.req.ebnf == ""
        return
    # The grammar of a reply made of one call of the forced functions.
    assert p.req.ebnf.startswith("start: call\n")
    names = {s["properties"]["name"]["const"] for s in _calls(p.req.ebnf)}
    assert names == set(forced)


def _calls(grammar: str) -> list[dict[str, Any]]:
    schema = json.loads(grammar.split("body: %json ", 1)[1])
    return schema.get("anyOf", [schema])


def test_allowed_tools_required_forces_a_call_of_the_allowed_tools_only():
    p = parse(tools=[FN, SHELL], tool_choice={"type": "allowed_tools", "mode": "required",
                                              "tools": [{"type": "function",
                                                         "name": "get_weather"}]})
    assert {s["properties"]["name"]["const"] for s in _calls(p.req.ebnf)} == {"get_weather"}


def test_parallel_tool_calls_lets_the_grammar_repeat_the_call():
    assert parse(tools=[FN], tool_choice="required").req.ebnf.startswith(
        'start: call ("\\n" call)*')


@pytest.mark.parametrize("tools,choice,says", [
    ([FN], {"type": "function", "name": "nope"}, "no function 'nope' in tools"),
    ([FN], {"type": "function", "name": "exec"}, "no function 'exec' in tools"),
    ([FN], {"type": "web_search"}, "type 'web_search' is not one of function"),
    ([FN], {"type": "custom", "name": "x"}, "type 'custom'"),
    ([FN], "sometimes", "'sometimes' is not one of"),
    (None, "required", "required needs tools"),
    ([{"type": "web_search"}], "required", "required needs tools"),
])
def test_a_tool_choice_that_cannot_be_served_is_refused_naming_tool_choice(tools, choice, says):
    e = refused(tools=tools, tool_choice=choice)
    assert e.code == 400 and e.param == "tool_choice" and says in e.message


def test_a_forced_tool_with_a_text_format_is_refused():
    e = refused(tools=[FN], tool_choice="required",
                text={"format": {"type": "json_object"}})
    assert e.param == "tool_choice"


# -- text.format, sampling, the rest of the body --------------------------------------------

def test_text_format_json_schema_and_json_object_are_the_requests_constraint():
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    p = parse(text={"format": {"type": "json_schema", "name": "count", "schema": schema,
                               "strict": True}, "verbosity": "low"})
    assert json.loads(p.req.json_schema) == schema
    assert parse(text={"format": {"type": "json_object"}}).req.json_schema == \
        '{"type": "object"}'
    assert parse(text={"format": {"type": "text"}}).req.json_schema == ""
    assert parse(text={"verbosity": "high"}).req.json_schema == ""


@pytest.mark.parametrize("fmt,says", [
    ({"type": "json_schema", "name": "x"}, "json_schema needs a schema"),
    ({"type": "yaml"}, "'yaml' is not one of text"),
])
def test_a_bad_text_format_is_refused_naming_text(fmt, says):
    e = refused(text={"format": fmt})
    assert e.code == 400 and e.param == "text" and says in e.message


def test_a_text_format_with_a_regex_is_refused():
    e = refused(text={"format": {"type": "json_object"}}, regex="a+")
    assert e.code == 400 and "regex" in e.message


def test_a_text_format_with_a_regex_is_refused_naming_text():
    e = refused(text={"format": {"type": "json_object"}}, regex="a+")
    assert e.param == "text" and "response_format" not in e.message


def test_sampling_and_output_fields_and_sglangs_extras():
    p = parse(max_output_tokens=77, temperature=0, top_p=0.5, top_k=40, seed=3, regex="[ab]+",
              reasoning={"effort": "none"}, prompt_cache_key="conv-1", stream=True,
              metadata={"k": "v"}, include=["reasoning.encrypted_content"], user="u",
              store=False, truncation="disabled", service_tier="auto")
    r = p.req
    assert (r.max_new_tokens, r.temperature, r.top_p, r.top_k, r.seed, r.regex, r.stream) == \
        (77, 0.0, 0.5, 40, 3, "[ab]+", True)
    assert r.chat_template_kwargs == {"enable_thinking": False} and r.session == "conv-1"
    assert parse(ebnf='start: "x"').req.ebnf == 'start: "x"'
    assert parse(reasoning={"effort": "high"}).req.chat_template_kwargs == {}
    assert parse_responses(body(prompt_cache_key="key"), LIMITS, session="hdr").req.session == \
        "hdr"


@pytest.mark.parametrize("fields,param", [
    ({"temperature": 2.5}, "temperature"), ({"temperature": -0.1}, "temperature"),
    ({"max_output_tokens": 0}, "max_output_tokens"), ({"top_p": 0}, "top_p"),
    ({"input": 5}, "input"), ({"input": [5]}, "input"), ({"tools": {}}, "tools"),
])
def test_out_of_range_fields_are_refused_naming_them(fields, param):
    e = refused(**fields)
    assert e.code == 400 and e.param == param, e.message


def test_malformed_json_and_empty_input_are_400s():
    with pytest.raises(RequestError) as e:
        parse_responses(b'{"input": "Hi"', LIMITS)
    assert e.value.code == 400 and "malformed" in e.value.message
    e = refused(input=[])
    assert e.code == 400 and e.param == "input"


@pytest.mark.parametrize("fields,param", [({"background": True}, "background"),
                                          ({"conversation": "conv_1"}, "conversation"),
                                          ({"conversation": {"id": "conv_1"}}, "conversation")])
def test_background_and_conversation_objects_are_refused(fields, param):
    e = refused(**fields)
    assert e.code == 400 and e.param == param


# -- bad items ------------------------------------------------------------------------------

@pytest.mark.parametrize("item,where", [
    ({"role": "user", "content": [{"type": "input_text", "text": "see"},
                                  {"type": "input_image", "image_url": "data:,"}]},
     "input[1].content[1]: input_image is not supported"),
    ({"role": "user", "content": [{"type": "input_file", "file_id": "f"}]},
     "input[1].content[0]: input_file is not supported"),
    (output("c", [{"type": "input_image", "image_url": "x"}]),
     "input[1].content[0]: input_image"),
    ({"role": "user", "content": [{"type": "input_text"}]},
     "input[1].content[0]: expected a text part"),
    ({"role": "user", "content": ["plain"]}, "input[1].content[0]: expected a text part"),
    ({"role": "user", "content": 5}, "input[1].content must be a string or a list"),
    ({"role": "critic", "content": "x"}, "input[1].role: 'critic' is not user"),
    ({"type": "message", "content": "x"}, "input[1].role: 'None' is not user"),
    ({"type": "item_reference", "id": "msg_1"}, "input[1]: item type 'item_reference'"),
    ({"type": "web_search_call", "id": "ws_1"}, "input[1]: item type 'web_search_call'"),
    ({"type": "function_call", "name": "f", "arguments": "{}"},
     "input[1]: a function_call needs call_id"),
    ({"type": "function_call", "call_id": "c", "name": "f", "arguments": {"a": 1}},
     "input[1]: a function_call needs call_id"),
    ({"type": "function_call_output", "output": "x"},
     "input[1]: a function_call_output needs a call_id"),
    ({"type": "reasoning", "content": [{"type": "input_image", "image_url": "x"}]},
     "input[1].content[0]: input_image"),
    ({"type": "reasoning", "summary": [{"type": "summary_text"}]},
     "input[1].content[0]: expected a text part"),
])
def test_a_bad_item_or_part_is_a_400_naming_where_it_is(item, where):
    e = refused(input=[user("first"), item])
    assert e.code == 400 and e.param == "input" and where in e.message, e.message


# -- previous_response_id -------------------------------------------------------------------

def test_previous_response_id_continues_its_conversation():
    before = [ChatMessageBody(role="user", content="Hi"),
              ChatMessageBody(role="assistant", content="Hello", reasoning_content="greet",
                              tool_calls=[{"id": "c1", "type": "function",
                                           "function": {"name": "f", "arguments": "{}"}}])]
    p = parse({"resp_1": before}, previous_response_id="resp_1", instructions="New rules.",
              input=[output("c1", "done"), user("And?")])
    assert turns(p.req) == [("system", "New rules."), ("user", "Hi"),
                            ("assistant", "Hello", "greet", [("c1", "f", "{}")]),
                            ("tool", "done", "c1"), ("user", "And?")]
    assert p.conversation[:2] == before and len(p.conversation) == 4


def test_an_unknown_previous_response_id_is_a_404_naming_it():
    e = refused(previous_response_id="resp_gone")
    assert e.code == 404 and e.param == "previous_response_id" and "resp_gone" in e.message


@pytest.mark.parametrize("body", [
    {"tools": [{"type": "namespace", "name": "n", "tools": 5}]},
    {"tools": [{"type": "function", "name": "f"}],
     "tool_choice": {"type": "allowed_tools", "tools": 5}},
    {"tools": [{"type": "function", "name": "f"}], "tool_choice": {"type": "function"}},
])
def test_a_wrong_shape_deep_in_tools_is_a_400_not_a_bug(body):
    """Free-form parts of the body (tools, tool_choice) are read by hand: a list where a list
    belongs, a name where a name belongs, or a 400 naming the field."""
    e = refused(**body)
    assert e.code == 400 and e.param in ("tools", "tool_choice")
