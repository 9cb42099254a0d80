"""OpenAI Responses bodies (POST /v1/responses) -> the chat body chat completions runs
(openai_format.ChatBody), so one conversation is one prompt on every endpoint. Pure: no
sockets, no event loop. The replies: responses_replies.py; the store behind
previous_response_id: response_store.py.

Input items become chat messages: messages of any role (developer as system), a turn's
reasoning, message and function calls as one assistant message (reasoning_content, content,
tool_calls), function_call_output as tool messages. Namespaced functions (a `namespace` tool
groups several) are shown to the model as `namespace.name`. Tools run on OpenAI's side
(web_search, file_search, code_interpreter, ...) and free-form custom tools are not shown to
the model; asking for them is not an error.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, Any, Callable

import msgspec
from msgspec import Meta

from actors.tokenizer.chat_output import unsign
from actors.tokenizer.intake import RequestError, decode_body
from actors.tokenizer.openai_format import (ChatBody, ChatMessageBody, FunctionBody,
                                            JsonSchemaFormat, ResponseFormat, ToolBody,
                                            chat_requests)
from protocol import messages as m
from protocol.config import LimitsConfig

# No max_output_tokens: the reply may run to the end of the context (the scheduler ends it
# there, or at limits.max_output_tokens).
UNBOUNDED = 1 << 40
ENCRYPTED_REASONING = "reasoning.encrypted_content"


class TextFormat(msgspec.Struct, kw_only=True):
    type: str = "text"  # text | json_object | json_schema
    name: str = ""
    schema: dict[str, Any] | None = None
    strict: bool | None = None


class TextConfig(msgspec.Struct, kw_only=True):
    format: TextFormat | None = None
    verbosity: str | None = None


class Reasoning(msgspec.Struct, kw_only=True):
    effort: str | None = None
    summary: str | None = None


class ResponsesBody(msgspec.Struct, kw_only=True):
    model: str = ""
    input: str | list[dict[str, Any]] = []
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    max_output_tokens: Annotated[int, Meta(ge=1)] | None = None
    temperature: Annotated[float, Meta(ge=0.0, le=2.0)] | None = None
    top_p: float | None = None
    text: TextConfig | None = None
    reasoning: Reasoning | None = None
    store: bool = True
    previous_response_id: str | None = None
    include: list[str] | None = None
    stream: bool = False
    metadata: dict[str, str] | None = None
    prompt_cache_key: str | None = None
    background: bool = False
    conversation: Any = None
    # sglang's extras, as on chat completions.
    top_k: Annotated[int, Meta(ge=-1)] = 0
    seed: int | None = None
    regex: str | None = None
    ebnf: str | None = None


NAMES = {"max_new_tokens": "max_output_tokens", "messages": "input", "temperature":
         "temperature", "top_p": "top_p", "json_schema": "text"}


@dataclass
class Parsed:
    """A responses request, and what its reply and the store need."""

    req: m.GenerateRequest
    body: ResponsesBody
    tools: bool  # tool calls are parsed out of the reply
    namespaces: dict[str, tuple[str, str]]  # shown name -> (namespace, name)
    conversation: list[ChatMessageBody] = field(default_factory=list)  # without instructions


def parse_responses(raw: bytes, limits: LimitsConfig,
                    history: Callable[[str], list[ChatMessageBody] | None] = lambda _: None,
                    session: str = "") -> Parsed:
    """A body -> its request. history: the conversation a stored response ends, by its id
    (for previous_response_id)."""
    b = decode_body(raw, ResponsesBody, limits)
    before: list[ChatMessageBody] = []
    if b.previous_response_id is not None:
        found = history(b.previous_response_id)
        if found is None:
            raise RequestError(f"previous response {b.previous_response_id[:80]!r} not found "
                               "(not stored, or dropped from the store)", 404,
                               param="previous_response_id")
        before = found
    if b.background:
        raise RequestError("background responses are not supported", param="background")
    if b.conversation is not None:
        raise RequestError("conversation objects are not supported: send the input, or "
                           "previous_response_id", param="conversation")
    tools, namespaces = _tools(b.tools or [])
    tools = _allowed(b.tool_choice, tools)
    fmt = _format(b.text)
    constrained = [k for k, v in (("text.format", fmt), ("regex", b.regex),
                                  ("ebnf", b.ebnf)) if v]
    if len(constrained) > 1:  # named as this API names them (chat's check says response_format)
        raise RequestError(f"give one of text.format, regex and ebnf, not "
                           f"{' and '.join(constrained)}", param="text")
    conversation = [*before, *input_messages(b.input)]
    messages = ([ChatMessageBody(role="system", content=b.instructions)]
                if b.instructions else []) + conversation
    if not messages:
        raise RequestError("input must not be empty", param="input")
    kwargs = {"enable_thinking": False} if b.reasoning and b.reasoning.effort == "none" else {}
    chat = ChatBody(
        model=b.model, messages=messages, stream=b.stream,
        max_tokens=b.max_output_tokens or UNBOUNDED,
        temperature=1.0 if b.temperature is None else b.temperature,
        top_p=1.0 if b.top_p is None else b.top_p, top_k=b.top_k, seed=b.seed,
        tools=tools or None, tool_choice=_tool_choice(b.tool_choice, namespaces),
        parallel_tool_calls=b.parallel_tool_calls, chat_template_kwargs=kwargs or None,
        response_format=fmt, regex=b.regex, ebnf=b.ebnf)
    reqs, opts = chat_requests(chat, session=session or b.prompt_cache_key or "", names=NAMES)
    return Parsed(reqs[0], b, opts["tools"], namespaces, conversation)


def _tools(specs: list[dict[str, Any]]) -> tuple[list[ToolBody], dict[str, tuple[str, str]]]:
    tools: list[ToolBody] = []
    namespaces: dict[str, tuple[str, str]] = {}
    for k, spec in enumerate(specs):
        kind = spec.get("type")
        if kind == "function":
            tools.append(_function(spec, f"tools[{k}]"))
        elif kind == "namespace":
            group = spec.get("name")
            if not isinstance(group, str) or not group:
                raise RequestError(f"tools[{k}]: a namespace needs a name", param="tools")
            inners = spec.get("tools") or []
            if not isinstance(inners, list):
                raise RequestError(f"tools[{k}].tools must be a list of function tools",
                                   param="tools")
            for j, inner in enumerate(inners):
                if isinstance(inner, dict) and inner.get("type", "function") == "function":
                    tool = _function(inner, f"tools[{k}].tools[{j}]", prefix=group + ".")
                    namespaces[tool.function.name] = (group, inner["name"])
                    tools.append(tool)
        elif not isinstance(kind, str):
            raise RequestError(f"tools[{k}]: a tool needs a type", param="tools")
        # Any other type is a tool OpenAI runs (web_search, ...) or a free-form custom tool:
        # nothing this model can be offered.
    return tools, namespaces


def _function(spec: dict[str, Any], where: str, prefix: str = "") -> ToolBody:
    name = spec.get("name")
    if not isinstance(name, str) or not name:
        raise RequestError(f"{where}: a function tool needs a name", param="tools")
    params = spec.get("parameters")
    if params is not None and not isinstance(params, dict):
        raise RequestError(f"{where}: parameters must be a JSON schema object", param="tools")
    description, strict = spec.get("description"), spec.get("strict")
    return ToolBody(type="function", function=FunctionBody(
        name=prefix + name, description=description if isinstance(description, str) else None,
        parameters=params or {"type": "object", "properties": {}},
        strict=strict if isinstance(strict, bool) else None))


def _tool_choice(choice: str | dict[str, Any] | None,
                 namespaces: dict[str, tuple[str, str]]) -> Any:
    if choice is None or isinstance(choice, str):
        return choice
    kind = choice.get("type")
    if kind == "function":
        name = choice.get("name")
        if not isinstance(name, str):
            raise RequestError('tool_choice: type function needs a "name"', param="tool_choice")
        if isinstance(choice.get("namespace"), str):
            name = f"{choice['namespace']}.{name}"
        return {"type": "function", "function": {"name": name}}
    if kind == "allowed_tools":  # its tools are picked by _allowed
        return choice.get("mode", "auto")
    raise RequestError(f"tool_choice: type {str(kind)[:40]!r} is not one of function, "
                       "allowed_tools (or auto, none, required)", param="tool_choice")


def _allowed(choice: Any, tools: list[ToolBody]) -> list[ToolBody]:
    """With tool_choice allowed_tools, the tools the model may call: those it names (by name,
    and namespace where it has one); the others are not shown."""
    if not isinstance(choice, dict) or choice.get("type") != "allowed_tools":
        return tools
    named = set()
    listed = choice.get("tools") or []
    if not isinstance(listed, list):
        raise RequestError("tool_choice.tools must be a list of tools", param="tool_choice")
    for k, t in enumerate(listed):
        name = t.get("name") if isinstance(t, dict) else None
        if not isinstance(name, str):
            raise RequestError(f"tool_choice.tools[{k}]: a tool needs a name",
                               param="tool_choice")
        named.add(f"{t['namespace']}.{name}" if isinstance(t.get("namespace"), str) else name)
    return [t for t in tools if t.function.name in named]


def _format(text: TextConfig | None) -> ResponseFormat | None:
    f = text.format if text is not None else None
    if f is None or f.type == "text":
        return None
    if f.type == "json_schema":
        if f.schema is None:
            raise RequestError("text.format: type json_schema needs a schema",
                               param="text")
        return ResponseFormat(type="json_schema", json_schema=JsonSchemaFormat(
            name=f.name, schema=f.schema, strict=f.strict))
    if f.type == "json_object":
        return ResponseFormat(type="json_object")
    raise RequestError(f"text.format: type {f.type[:40]!r} is not one of text, json_object, "
                       "json_schema", param="text")


def input_messages(value: str | list[dict[str, Any]]) -> list[ChatMessageBody]:
    """Input items -> chat messages; one turn's reasoning, assistant message and function
    calls merge into one assistant message, as the template shows a turn."""
    if isinstance(value, str):
        return [ChatMessageBody(role="user", content=value)]
    out: list[ChatMessageBody] = []
    turn: ChatMessageBody | None = None  # the assistant turn being gathered
    names: dict[str, str] = {}  # call_id -> the function's shown name

    def assistant(fresh: bool) -> ChatMessageBody:
        nonlocal turn
        if turn is None or (fresh and (turn.content or turn.tool_calls)):
            turn = ChatMessageBody(role="assistant", content="")
            out.append(turn)
        return turn

    for k, item in enumerate(value):
        where = f"input[{k}]"
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role == "assistant":
                msg = assistant(fresh=True)
                msg.content = (msg.content or "") + _text(item.get("content"), where)
                continue
            if role not in ("user", "system", "developer"):
                raise RequestError(f"{where}.role: {str(role)[:40]!r} is not user, assistant, "
                                   "system or developer", param="input")
            turn = None
            out.append(ChatMessageBody(role="system" if role == "developer" else role,
                                       content=_text(item.get("content"), where)))
        elif kind == "reasoning":
            msg = assistant(fresh=True)
            msg.reasoning_content = (msg.reasoning_content or "") + _reasoning(item, where)
        elif kind == "function_call":
            call_id, name = item.get("call_id"), item.get("name")
            args = item.get("arguments", "{}")
            if not isinstance(call_id, str) or not isinstance(name, str) or \
                    not isinstance(args, str):
                raise RequestError(f"{where}: a function_call needs call_id, name and "
                                   "arguments (a JSON string)", param="input")
            if isinstance(item.get("namespace"), str):
                name = f"{item['namespace']}.{name}"
            names[call_id] = name
            msg = assistant(fresh=False)
            msg.tool_calls = [*(msg.tool_calls or []), {
                "id": call_id, "type": "function",
                "function": {"name": name, "arguments": args}}]
        elif kind == "function_call_output":
            call_id = item.get("call_id")
            if not isinstance(call_id, str):
                raise RequestError(f"{where}: a function_call_output needs a call_id",
                                   param="input")
            turn = None
            out.append(ChatMessageBody(role="tool", tool_call_id=call_id,
                                       name=names.get(call_id),
                                       content=_text(item.get("output"), where)))
        else:
            raise RequestError(f"{where}: item type {str(kind)[:40]!r} is not supported here "
                               "(message, reasoning, function_call, function_call_output)",
                               param="input")
    return out


_TEXT_PARTS = ("input_text", "output_text", "text", "refusal", "summary_text", "reasoning_text")


def _text(content: Any, where: str) -> str:
    """A message's or an output's text: a string, or its text parts joined."""
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list):
        raise RequestError(f"{where}.content must be a string or a list of parts",
                           param="input")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_image", "input_file", "input_audio"):
            raise RequestError(f"{where}.content[{j}]: {kind} is not supported: this server's "
                               "model reads text only", param="input")
        text = part.get("text", part.get("refusal")) if kind in _TEXT_PARTS else None
        if not isinstance(text, str):
            raise RequestError(f"{where}.content[{j}]: expected a text part (input_text, "
                               f"output_text), got {str(kind)[:40]!r}", param="input")
        texts.append(text)
    return "".join(texts)


def _reasoning(item: dict[str, Any], where: str) -> str:
    """A reasoning item's text: its content, else what its encrypted_content (ours) carries,
    else its summary."""
    content, summary, sealed = (item.get(k) for k in ("content", "summary",
                                                      "encrypted_content"))
    if isinstance(content, list) and content:
        return _text(content, where)
    text = unsign(sealed) if isinstance(sealed, str) else ""
    if not text and isinstance(summary, list) and summary:
        return _text(summary, where)
    return text


def reply_tool_call(name: str, namespaces: dict[str, tuple[str, str]]) -> dict[str, str]:
    """A called function's fields in a function_call item: its name, and its namespace if
    it is one of a namespace's."""
    if name in namespaces:
        group, inner = namespaces[name]
        return {"name": inner, "namespace": group}
    return {"name": name}

