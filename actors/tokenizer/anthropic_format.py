"""Anthropic Messages bodies (POST /v1/messages, /v1/messages/count_tokens) -> the chat body
chat completions runs (openai_format.ChatBody), so one conversation is one prompt on every
endpoint. Pure functions: no sockets, no event loop. The replies: anthropic_replies.py.

What a client sends that means nothing here is accepted and dropped: cache_control (the
prefix cache needs no marks), metadata, context_management, output_config, service_tier,
beta headers. Tools the server runs itself on Anthropic's side (web search, code execution:
a `type` other than "custom") and deferred tools (defer_loading) are not shown to the model.
"""

from __future__ import annotations

import json
from typing import Annotated, Any

import msgspec
from msgspec import Meta

from actors.tokenizer.chat_output import unsign
from actors.tokenizer.intake import RequestError, decode_body
from actors.tokenizer.openai_format import (ChatBody, ChatMessageBody, FunctionBody, ToolBody,
                                            chat_requests)
from protocol import messages as m
from protocol.config import LimitsConfig

# Claude Code's first system block: its version and a hash of the conversation, different
# on every request. At the front of the prompt it would defeat the prefix cache on every
# turn, and it tells the model nothing: it is dropped.
VOLATILE_HEADER = "x-anthropic-billing-header:"


class Block(msgspec.Struct, kw_only=True):
    """A content block of any type (the fields each type uses)."""

    type: str
    text: str | None = None
    id: str | None = None  # tool_use
    name: str | None = None
    input: Any = None
    tool_use_id: str | None = None  # tool_result
    content: str | list[Block] | None = None
    is_error: bool = False
    thinking: str | None = None  # thinking
    signature: str | None = None


class MessageBody(msgspec.Struct, kw_only=True):
    role: str
    content: str | list[Block]


class ToolSpec(msgspec.Struct, kw_only=True):
    name: str
    description: str = ""
    input_schema: dict[str, Any] | None = None
    type: str | None = None  # "custom" or absent: the client's function
    defer_loading: bool = False


class ToolChoice(msgspec.Struct, kw_only=True):
    type: str
    name: str | None = None
    disable_parallel_tool_use: bool = False


class Thinking(msgspec.Struct, kw_only=True):
    type: str  # enabled | adaptive | disabled
    budget_tokens: int | None = None
    display: str | None = None  # "omitted": blocks carry the signature only


class MessagesBody(msgspec.Struct, kw_only=True):
    model: str
    messages: list[MessageBody]
    max_tokens: Annotated[int, Meta(ge=1)]
    system: str | list[Block] | None = None
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: Annotated[float, Meta(ge=0.0, le=1.0)] = 1.0
    top_p: float | None = None
    top_k: Annotated[int, Meta(ge=0)] | None = None
    tools: list[ToolSpec] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    # sglang's extras, as on chat completions: the reply matches this regex or grammar.
    regex: str | None = None
    ebnf: str | None = None


class CountBody(msgspec.Struct, kw_only=True):
    """count_tokens: a messages body without max_tokens."""

    model: str = ""
    messages: list[MessageBody]
    system: str | list[Block] | None = None
    tools: list[ToolSpec] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None


# GenerateRequest's field -> the Anthropic field a client set it with, for error messages.
NAMES = {"max_new_tokens": "max_tokens", "stop": "stop_sequences", "messages": "messages",
         "top_k": "top_k", "top_p": "top_p", "temperature": "temperature"}


def parse_messages(raw: bytes, limits: LimitsConfig,
                   session: str = "") -> tuple[m.GenerateRequest, dict[str, Any]]:
    """A /v1/messages body -> its one request, and what the reply needs to know (opts:
    model, stream, tools offered, thinking shown)."""
    b = decode_body(raw, MessagesBody, limits)
    chat = _chat_body(b, max_tokens=b.max_tokens, temperature=b.temperature, stream=b.stream,
                      top_p=1.0 if b.top_p is None else b.top_p, top_k=b.top_k or 0,
                      stop=list(b.stop_sequences or []), regex=b.regex, ebnf=b.ebnf)
    reqs, opts = chat_requests(chat, session=session, names=NAMES)
    opts["omit_thinking"] = b.thinking is not None and b.thinking.display == "omitted"
    return reqs[0], opts


def parse_count(raw: bytes, limits: LimitsConfig) -> m.GenerateRequest:
    """A count_tokens body -> the request whose prompt tokens it counts (the prompt
    /v1/messages would build)."""
    b = decode_body(raw, CountBody, limits)
    reqs, _ = chat_requests(_chat_body(b, max_tokens=1), names=NAMES)
    return reqs[0]


def _chat_body(b: MessagesBody | CountBody, **sampling: Any) -> ChatBody:
    messages = [*_system(b.system), *_turns(b.messages)]
    if not any(msg.role != "system" for msg in messages):
        raise RequestError("messages: at least one user message is required", param="messages")
    tools = [ToolBody(type="function", function=FunctionBody(
                name=t.name, description=t.description or None,
                parameters=t.input_schema or {"type": "object", "properties": {}}))
             for t in b.tools or [] if t.type in (None, "custom") and not t.defer_loading]
    choice, parallel = _tool_choice(b.tool_choice, tools)
    kwargs: dict[str, Any] = {"enable_thinking": False} \
        if b.thinking and b.thinking.type == "disabled" else {}
    if messages[-1].role == "assistant" and not messages[-1].tool_calls:
        kwargs["continue_final_message"] = True  # a prefill: the reply goes on from its text
    return ChatBody(model=b.model, messages=messages, **sampling, tools=tools or None,
                    tool_choice=choice, parallel_tool_calls=parallel,
                    chat_template_kwargs=kwargs or None)


def _tool_choice(choice: ToolChoice | None, tools: list[ToolBody]) -> tuple[Any, bool]:
    """Anthropic's tool_choice as chat completions' (auto, none, required, or one function)
    and whether several calls may come in one reply."""
    if choice is None:
        return ("auto" if tools else None), True
    parallel = not choice.disable_parallel_tool_use
    if choice.type in ("auto", "none"):
        return choice.type, parallel
    if not tools:
        raise RequestError(f"tool_choice: type {choice.type!r} needs tools", param="tool_choice")
    if choice.type == "any":
        return "required", parallel
    if choice.type == "tool":
        if not choice.name:
            raise RequestError("tool_choice: type tool needs a name", param="tool_choice")
        if choice.name not in {t.function.name for t in tools}:
            raise RequestError(f"tool_choice: no tool {choice.name[:60]!r} in tools",
                               param="tool_choice")
        return {"type": "function", "function": {"name": choice.name}}, parallel
    raise RequestError(f"tool_choice: type {choice.type[:40]!r} is not one of auto, any, tool, "
                       "none", param="tool_choice")


def _system(system: str | list[Block] | None) -> list[ChatMessageBody]:
    if system is None:
        return []
    if isinstance(system, str):
        return [ChatMessageBody(role="system", content=system)] if system else []
    texts = []
    for k, block in enumerate(system):
        if block.type != "text" or block.text is None:
            raise RequestError(f"system[{k}]: only text blocks are taken, got "
                               f"{block.type[:40]!r}", param="system")
        if not block.text.startswith(VOLATILE_HEADER):
            texts.append(block.text)
    return [ChatMessageBody(role="system", content="\n".join(texts))] if texts else []


def _turns(messages: list[MessageBody]) -> list[ChatMessageBody]:
    """Anthropic turns as chat messages: a user turn's tool_result blocks become tool
    messages (before its text, as Anthropic orders them), an assistant turn's tool_use
    blocks its tool_calls and its thinking its reasoning_content."""
    out: list[ChatMessageBody] = []
    names: dict[str, str] = {}  # tool_use id -> the tool's name
    for i, msg in enumerate(messages):
        where = f"messages[{i}]"
        if msg.role not in ("user", "assistant", "system"):
            raise RequestError(f"{where}.role: {msg.role[:40]!r} is not user or assistant",
                               param="messages")
        blocks = [Block(type="text", text=msg.content)] if isinstance(msg.content, str) \
            else msg.content
        if msg.role == "assistant":
            out.append(_assistant(blocks, where, names))
            continue
        texts = []
        for k, block in enumerate(blocks):
            if block.type == "text":
                texts.append(_text(block, f"{where}.content[{k}]"))
            elif block.type == "tool_result" and msg.role == "user":
                call = block.tool_use_id or ""
                result = _result_text(block.content, f"{where}.content[{k}]")
                out.append(ChatMessageBody(role="tool", tool_call_id=call,
                                           name=names.get(call), content=(
                                               "Error: " + result if block.is_error
                                               else result)))
            else:
                raise _unsupported(block, f"{where}.content[{k}]")
        if texts or not blocks:
            out.append(ChatMessageBody(role=msg.role, content="\n".join(texts)))
    return out


def _assistant(blocks: list[Block], where: str, names: dict[str, str]) -> ChatMessageBody:
    texts, thoughts, calls = [], [], []
    for k, block in enumerate(blocks):
        at = f"{where}.content[{k}]"
        if block.type == "text":
            texts.append(_text(block, at))
        elif block.type == "thinking":
            thoughts.append(block.thinking or unsign(block.signature or ""))
        elif block.type == "redacted_thinking":
            continue  # another server's opaque reasoning: nothing to show the model
        elif block.type == "tool_use":
            if not block.id or not block.name:
                raise RequestError(f"{at}: a tool_use block needs an id and a name",
                                   param="messages")
            names[block.id] = block.name
            calls.append({"id": block.id, "type": "function", "function": {
                "name": block.name,
                "arguments": json.dumps(block.input if block.input is not None else {},
                                        ensure_ascii=False)}})
        else:
            raise _unsupported(block, at)
    return ChatMessageBody(role="assistant", content="".join(texts), tool_calls=calls or None,
                           reasoning_content="".join(thoughts) or None)


def _text(block: Block, where: str) -> str:
    if block.text is None:
        raise RequestError(f"{where}: a text block needs a string `text`", param="messages")
    return block.text


def _result_text(content: str | list[Block] | None, where: str) -> str:
    """A tool_result's content as text: a string, or its text blocks joined (a tool search's
    tool_reference blocks say nothing the model reads)."""
    if content is None or isinstance(content, str):
        return content or ""
    texts = []
    for k, block in enumerate(content):
        if block.type == "text":
            texts.append(_text(block, f"{where}.content[{k}]"))
        elif block.type != "tool_reference":
            raise _unsupported(block, f"{where}.content[{k}]")
    return "\n".join(texts)


def _unsupported(block: Block, where: str) -> RequestError:
    if block.type in ("image", "document"):
        return RequestError(f"{where}: {block.type} blocks are not supported: this server's "
                            "model reads text only", param="messages")
    return RequestError(f"{where}: content block type {block.type[:40]!r} is not supported "
                        "here (text, tool_use, tool_result, thinking)", param="messages")
