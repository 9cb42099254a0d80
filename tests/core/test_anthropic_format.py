"""Anthropic Messages bodies as requests (actors/tokenizer/anthropic_format.py): system blocks,
tool use and results, thinking and its signature, tool_choice, and the errors, each naming the
field; and the property the module exists for: one conversation sent as chat completions or as
Anthropic messages is one GenerateRequest prompt (messages, tools, template arguments)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from actors.tokenizer.anthropic_format import parse_count, parse_messages
from actors.tokenizer.chat_output import sign, unsign
from actors.tokenizer.intake import RequestError
from actors.tokenizer.openai_format import parse_chat
from protocol import messages as m
from protocol.config import LimitsConfig

LIMITS = LimitsConfig()
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}},
           "required": ["city"]}
TOOL = {"name": "get_weather", "description": "Forecast", "input_schema": WEATHER}
TIME = {"name": "get_time", "input_schema": {"type": "object", "properties": {}}}


def body(**fields: Any) -> bytes:
    """A /v1/messages body: one user turn unless messages are given."""
    b = {"model": "claude-x", "max_tokens": 64,
         "messages": [{"role": "user", "content": "Hi"}], **fields}
    return json.dumps({k: v for k, v in b.items() if v is not None}).encode()


def parse(**fields: Any) -> tuple[m.GenerateRequest, dict[str, Any]]:
    return parse_messages(body(**fields), LIMITS)


def refused(**fields: Any) -> RequestError:
    with pytest.raises(RequestError) as e:
        parse(**fields)
    return e.value


def roles(req: m.GenerateRequest) -> list[tuple[str, str]]:
    return [(msg.role, msg.content) for msg in req.messages]


# -- system ---------------------------------------------------------------------------------

def test_system_text_blocks_are_joined_and_the_billing_header_dropped():
    req, _ = parse(system=[
        {"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1.3; cch=ab12;"},
        {"type": "text", "text": "You are Claude Code.", "cache_control": {"type": "ephemeral"}},
        {"type": "text", "text": "Be terse."}])
    assert roles(req) == [("system", "You are Claude Code.\nBe terse."), ("user", "Hi")]


def test_a_system_string_and_a_system_of_only_the_header():
    assert roles(parse(system="Be terse.")[0])[0] == ("system", "Be terse.")
    only = parse(system=[{"type": "text", "text": "x-anthropic-billing-header: v=1"}])[0]
    assert roles(only) == [("user", "Hi")]
    assert roles(parse(system="")[0]) == [("user", "Hi")]


def test_a_system_block_that_is_not_text_is_refused_naming_it():
    e = refused(system=[{"type": "text", "text": "a"}, {"type": "image", "source": {}}])
    assert e.code == 400 and e.param == "system" and "system[1]" in e.message


# -- tool use and tool results -----------------------------------------------------------------

CALLED = [
    {"role": "user", "content": "Weather in Oslo and the time?"},
    {"role": "assistant", "content": [
        {"type": "text", "text": "Checking."},
        {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
         "input": {"city": "Oslo", "note": "ø"}},
        {"type": "tool_use", "id": "toolu_2", "name": "get_time", "input": {}}]},
    {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_2", "content": "12:00"},
        {"type": "text", "text": "Thanks."},
        {"type": "tool_result", "tool_use_id": "toolu_1", "is_error": True,
         "content": [{"type": "text", "text": "timeout"}, {"type": "text", "text": "retry"}]}]},
]


def test_tool_use_blocks_become_the_turns_tool_calls_with_json_arguments():
    req, _ = parse(messages=CALLED, tools=[TOOL, TIME])
    turn = req.messages[1]
    assert (turn.role, turn.content) == ("assistant", "Checking.")
    assert turn.tool_calls == [
        {"id": "toolu_1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Oslo", "note": "ø"}'}},
        {"id": "toolu_2", "type": "function", "function": {
            "name": "get_time", "arguments": "{}"}}]


def test_tool_results_come_before_the_turns_text_in_order_with_the_tools_names():
    req, _ = parse(messages=CALLED, tools=[TOOL, TIME])
    assert [(msg.role, msg.tool_call_id, msg.name, msg.content) for msg in req.messages[2:]] == [
        ("tool", "toolu_2", "get_time", "12:00"),
        ("tool", "toolu_1", "get_weather", "Error: timeout\nretry"),
        ("user", "", "", "Thanks.")]


def test_a_turn_of_only_tool_results_adds_no_empty_user_message():
    turns = CALLED[:2] + [{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_1"},
        {"type": "tool_result", "tool_use_id": "toolu_2", "content": [
            {"type": "tool_reference", "tool_name": "x"}]}]}]
    req, _ = parse(messages=turns, tools=[TOOL, TIME])
    assert roles(req)[2:] == [("tool", ""), ("tool", "")]


def test_a_tool_use_without_an_id_is_refused_naming_the_block():
    e = refused(messages=[{"role": "user", "content": "a"}, {"role": "assistant", "content": [
        {"type": "text", "text": "b"}, {"type": "tool_use", "name": "f", "input": {}}]}])
    assert e.code == 400 and "messages[1].content[1]" in e.message


# -- thinking --------------------------------------------------------------------------------

@settings(max_examples=100, deadline=None)
@given(st.text(st.characters(blacklist_categories=("Cs",))))
def test_a_signature_unsigns_to_its_thinking(text):
    assert sign(text).startswith("mas1:") and unsign(sign(text)) == text


@pytest.mark.parametrize("signature", ["", "EqQBCkgIAhABGAIiQL", "mas1:!!not base64",
                                       "mas1:" + "//79"])  # the last: valid base64, not UTF-8
def test_a_foreign_or_broken_signature_unsigns_to_nothing(signature):
    assert unsign(signature) == ""


def _thought(block: dict[str, Any]) -> str:
    req, _ = parse(messages=[{"role": "user", "content": "a"},
                             {"role": "assistant", "content": [
                                 block, {"type": "redacted_thinking", "data": "opaque"},
                                 {"type": "text", "text": "b"}]},
                             {"role": "user", "content": "c"}])
    assert roles(req) == [("user", "a"), ("assistant", "b"), ("user", "c")]
    return req.messages[1].reasoning_content


def test_thinking_is_the_turns_reasoning_content_and_an_omitted_one_comes_from_its_signature():
    assert _thought({"type": "thinking", "thinking": "Plan: rain.", "signature": "opaque"}) == \
        "Plan: rain."
    assert _thought({"type": "thinking", "thinking": "", "signature": sign("Plan: rain.")}) == \
        "Plan: rain."
    assert _thought({"type": "thinking", "thinking": "", "signature": "another server's"}) == ""


def test_thinking_display_omitted_and_thinking_disabled():
    _, opts = parse(thinking={"type": "enabled", "budget_tokens": 1024, "display": "omitted"})
    assert opts["omit_thinking"]
    req, opts = parse(thinking={"type": "adaptive"})
    assert not opts["omit_thinking"] and req.chat_template_kwargs == {}
    req, _ = parse(thinking={"type": "disabled"})
    assert req.chat_template_kwargs == {"enable_thinking": False}


def test_a_last_assistant_turn_is_a_prefill_the_reply_continues():
    turns = [{"role": "user", "content": "Rain?"}, {"role": "assistant", "content": "Yes, "}]
    req, _ = parse(messages=turns, thinking={"type": "disabled"})
    assert roles(req)[-1] == ("assistant", "Yes, ")
    assert req.chat_template_kwargs == {"enable_thinking": False,
                                        "continue_final_message": True}
    counted = parse_count(json.dumps({"messages": turns}).encode(), LIMITS)
    assert counted.chat_template_kwargs == {"continue_final_message": True}
    assert parse()[0].chat_template_kwargs == {}  # a last user turn: a new assistant turn


# -- tools and tool_choice -----------------------------------------------------------------------

def test_server_tools_and_deferred_tools_are_not_shown():
    req, opts = parse(tools=[
        TOOL, {"type": "web_search_20250305", "name": "web_search", "max_uses": 5},
        {"type": "custom", "name": "get_time", "input_schema": TIME["input_schema"]},
        {"name": "rare_tool", "input_schema": WEATHER, "defer_loading": True},
        {"type": "tool_search_tool_regex_20251119", "name": "tool_search"}])
    assert [t["function"]["name"] for t in req.tools] == ["get_weather", "get_time"]
    assert req.tools[0] == {"type": "function", "function": {
        "name": "get_weather", "description": "Forecast", "parameters": WEATHER,
        "strict": None}}
    assert opts["tools"]


def test_only_server_tools_is_no_tools():
    req, opts = parse(tools=[{"type": "web_search_20250305", "name": "web_search"}])
    assert req.tools == [] and not opts["tools"] and req.ebnf == ""


def test_a_tool_without_input_schema_takes_any_object():
    req, _ = parse(tools=[{"name": "ping"}])
    assert req.tools[0]["function"]["parameters"] == {"type": "object", "properties": {}}


@pytest.mark.parametrize("choice, grammar, shown", [
    (None, False, True), ({"type": "auto"}, False, True), ({"type": "none"}, False, False),
    ({"type": "any"}, True, True), ({"type": "tool", "name": "get_time"}, True, True)])
def test_tool_choice_as_chat_completions_takes_it(choice, grammar, shown):
    req, opts = parse(tools=[TOOL, TIME], tool_choice=choice)
    assert bool(req.ebnf) == grammar and opts["tools"] == shown
    assert len(req.tools) == 2  # every tool is shown to the model, whatever the choice


def test_a_forced_tool_grammar_names_only_that_tool_and_parallel_follows_the_flag():
    req, _ = parse(tools=[TOOL, TIME], tool_choice={"type": "tool", "name": "get_time"})
    assert '"get_time"' in req.ebnf and '"get_weather"' not in req.ebnf
    assert req.ebnf.startswith('start: call ("\\n" call)*')
    req, _ = parse(tools=[TOOL, TIME], tool_choice={"type": "any",
                                                    "disable_parallel_tool_use": True})
    assert '"get_time"' in req.ebnf and '"get_weather"' in req.ebnf
    assert req.ebnf.splitlines()[0] == "start: call"


@pytest.mark.parametrize("tools, choice, says", [
    ([TOOL], {"type": "tool", "name": "nope"}, "no tool 'nope'"),
    ([TOOL], {"type": "tool"}, "needs a name"),
    (None, {"type": "any"}, "needs tools"),
    ([{"type": "web_search_20250305", "name": "web_search"}], {"type": "any"}, "needs tools"),
    ([{"name": "later", "defer_loading": True}], {"type": "tool", "name": "later"}, "needs tools"),
    ([TOOL], {"type": "sometimes"}, "not one of auto, any, tool, none"),
])
def test_a_tool_choice_that_cannot_be_served_is_refused_naming_tool_choice(tools, choice, says):
    e = refused(tools=tools, tool_choice=choice)
    assert (e.code, e.param) == (400, "tool_choice") and says in e.message


def test_a_forced_tool_with_a_regex_is_refused():
    e = refused(tools=[TOOL], tool_choice={"type": "any"}, regex="[a-z]+")
    assert e.param == "tool_choice"


# -- content blocks and fields refused -------------------------------------------------------------

IMAGE = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}


@pytest.mark.parametrize("turns, where", [
    ([{"role": "user", "content": [{"type": "text", "text": "see"}, IMAGE]}],
     "messages[0].content[1]"),
    ([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
      {"role": "user", "content": [{"type": "document", "source": {}}]}],
     "messages[2].content[0]"),
    ([{"role": "user", "content": "a"},
      {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f",
                                         "input": {}}]},
      {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t",
                                    "content": [{"type": "text", "text": "x"}, IMAGE]}]}],
     "messages[2].content[0].content[1]"),
])
def test_an_image_or_document_is_a_400_naming_where_it_is(turns, where):
    e = refused(messages=turns)
    assert e.code == 400 and e.param == "messages"
    assert e.message.startswith(where + ":") and "not supported" in e.message


@pytest.mark.parametrize("turns, says", [
    ([{"role": "user", "content": [{"type": "server_tool_use", "id": "s"}]}],
     "messages[0].content[0]: content block type 'server_tool_use'"),
    ([{"role": "assistant", "content": [{"type": "tool_result", "tool_use_id": "t"}]}],
     "messages[0].content[0]"),  # a tool result in the assistant's turn
    ([{"role": "user", "content": [{"type": "text"}]}], "messages[0].content[0]: a text block"),
    ([{"role": "tool", "content": "x"}], "messages[0].role"),
    ([], "at least one user message"),
])
def test_malformed_turns_are_400s_naming_where(turns, says):
    e = refused(messages=turns)
    assert e.code == 400 and says in e.message


@pytest.mark.parametrize("max_tokens", [None, 0, -1])
def test_max_tokens_is_required_and_positive(max_tokens):
    raw = json.loads(body())
    raw.pop("max_tokens")
    if max_tokens is not None:
        raw["max_tokens"] = max_tokens
    with pytest.raises(RequestError) as e:
        parse_messages(json.dumps(raw).encode(), LIMITS)
    assert e.value.code == 400 and "max_tokens" in e.value.message


@pytest.mark.parametrize("fields, name", [
    ({"temperature": 1.5}, "temperature"), ({"temperature": -0.1}, "temperature"),
    ({"top_k": -1}, "top_k"), ({"top_p": 0}, "top_p"), ({"stop_sequences": "END"},
                                                          "stop_sequences")])
def test_sampling_out_of_anthropics_range_is_refused_naming_the_field(fields, name):
    e = refused(**fields)
    assert e.code == 400 and e.param == name and name in e.message


def test_malformed_json_is_a_400():
    with pytest.raises(RequestError) as e:
        parse_messages(b'{"model": "x", "max_tokens": 4, "messages": [', LIMITS)
    assert e.value.code == 400 and e.value.message.startswith("malformed request")


def test_fields_a_client_sends_that_mean_nothing_here_are_accepted():
    req, _ = parse(
        messages=[{"role": "user", "content": [
            {"type": "text", "text": "Hi", "cache_control": {"type": "ephemeral", "ttl": "1h"},
             "citations": None}]}],
        system=[{"type": "text", "text": "S", "cache_control": {"type": "ephemeral"}}],
        tools=[{**TOOL, "cache_control": {"type": "ephemeral"}, "eager_input_streaming": True}],
        metadata={"user_id": "u-1"}, context_management={"edits": []},
        output_config={"effort": "high"}, service_tier="auto", container=None,
        mcp_servers=[])
    assert roles(req) == [("system", "S"), ("user", "Hi")]
    assert req.max_new_tokens == 64


# -- sampling --------------------------------------------------------------------------------

def test_sampling_defaults_and_values():
    req, opts = parse()
    assert (req.temperature, req.top_p, req.top_k, req.stop, req.stream) == \
        (1.0, 1.0, 0, [], False)
    assert opts["model"] == "claude-x" and not opts["tools"]
    req, opts = parse(temperature=0, top_p=0.9, top_k=40, stop_sequences=["END", "\n\n"],
                      stream=True, max_tokens=32000)
    assert (req.temperature, req.top_p, req.top_k, req.stop, req.stream, req.max_new_tokens) == \
        (0.0, 0.9, 40, ["END", "\n\n"], True, 32000)
    assert opts["stream"]


def test_regex_and_ebnf_extras_and_the_session():
    assert parse(regex="[a-z]+")[0].regex == "[a-z]+"
    assert parse(ebnf='start: "a"')[0].ebnf == 'start: "a"'
    req, _ = parse_messages(body(), LIMITS, session="sess-1")
    assert req.session == "sess-1"


def test_count_tokens_counts_the_prompt_messages_would_build():
    fields = dict(system=[{"type": "text", "text": "S"}], messages=CALLED, tools=[TOOL, TIME],
                  tool_choice={"type": "any"}, thinking={"type": "disabled"})
    req, _ = parse(**fields)
    counted = parse_count(json.dumps({"model": "x", **fields}).encode(), LIMITS)
    assert (counted.messages, counted.tools, counted.chat_template_kwargs) == \
        (req.messages, req.tools, req.chat_template_kwargs)
    # count_tokens needs no model and no max_tokens
    assert parse_count(b'{"messages": [{"role": "user", "content": "a"}]}', LIMITS).messages == \
        [m.ChatMessage(role="user", content="a")]


# -- one conversation, one prompt ------------------------------------------------------------------

# A conversation in neutral form: a user turn, then assistant turns, each with a thought, text and
# calls, answered by a user turn of the calls' results and maybe text.
words = st.text(st.sampled_from("ab ø🎉\n{}\""), min_size=1, max_size=8)
calls = st.lists(st.tuples(st.sampled_from(["get_weather", "get_time"]),
                           st.dictionaries(st.sampled_from(["city", "n"]),
                                           st.one_of(words, st.integers(-5, 5)), max_size=2)),
                 max_size=2)
assistant = st.tuples(st.one_of(st.just(""), words), st.one_of(st.just(""), words), calls)
answers = st.lists(st.tuples(words, st.booleans()), min_size=2, max_size=2)  # (result, is_error)
conversations = st.tuples(st.one_of(st.just(""), words), words,
                          st.lists(st.tuples(assistant, answers, st.one_of(st.just(""), words)),
                                   max_size=3))


def _both(convo: tuple) -> tuple[dict[str, Any], dict[str, Any]]:
    """The conversation as an Anthropic body and as a chat completions body."""
    system, first, rounds = convo
    anth: list[dict[str, Any]] = [{"role": "user", "content": first}]
    chat: list[dict[str, Any]] = [{"role": "system", "content": system}] if system else []
    chat.append({"role": "user", "content": first})
    n = 0
    for (thought, text, made), results, after in rounds:
        ids = [f"toolu_{n + k}" for k in range(len(made))]
        n += len(made)
        blocks: list[dict[str, Any]] = []
        if thought:
            blocks.append({"type": "thinking", "thinking": thought, "signature": sign(thought)})
        if text:
            blocks.append({"type": "text", "text": text})
        blocks += [{"type": "tool_use", "id": i, "name": name, "input": args}
                   for i, (name, args) in zip(ids, made)]
        anth.append({"role": "assistant", "content": blocks})
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if thought:
            message["reasoning_content"] = thought
        if made:
            message["tool_calls"] = [{"id": i, "type": "function", "function": {
                "name": name, "arguments": json.dumps(args, ensure_ascii=False)}}
                for i, (name, args) in zip(ids, made)]
        chat.append(message)
        user: list[dict[str, Any]] = [
            {"type": "tool_result", "tool_use_id": i, "content": result, "is_error": error}
            for i, (result, error) in zip(ids, results)]
        chat += [{"role": "tool", "tool_call_id": i, "name": name,
                  "content": ("Error: " if error else "") + result}
                 for i, (name, _), (result, error) in zip(ids, made, results)]
        if after:
            user.append({"type": "text", "text": after})
            chat.append({"role": "user", "content": after})
        if user:
            anth.append({"role": "user", "content": user})
    common = {"model": "m", "max_tokens": 50, "temperature": 0.5}
    kwargs = {"enable_thinking": False}
    if chat[-1]["role"] == "assistant":  # ends with a prefill
        kwargs["continue_final_message"] = True
    return ({**common, "system": system or None, "messages": anth,
             "tools": [TOOL, TIME], "thinking": {"type": "disabled"}},
            {**common, "messages": chat, "chat_template_kwargs": kwargs,
             "tools": [{"type": "function", "function": {
                 "name": t["name"], "description": t.get("description"),
                 "parameters": t["input_schema"]}} for t in (TOOL, TIME)]})


@settings(max_examples=150, deadline=None)
@given(conversations)
def test_one_conversation_is_one_request_on_both_apis(convo):
    anth, chat = _both(convo)
    a, _ = parse_messages(json.dumps({k: v for k, v in anth.items() if v is not None}).encode(),
                          LIMITS)
    (c,), _ = parse_chat(json.dumps(chat).encode(), LIMITS)
    assert a.messages == c.messages
    assert (a.tools, a.chat_template_kwargs, a.max_new_tokens, a.temperature) == \
        (c.tools, c.chat_template_kwargs, c.max_new_tokens, c.temperature)
