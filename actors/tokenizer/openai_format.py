"""OpenAI request bodies -> GenerateRequests (the replies' objects: openai_replies.py).
Pure functions: no sockets, no event loop.

A body is decoded by the intake boundary (actors/tokenizer/intake.py); its fields then become a
GenerateRequest through the same schema ZMQ clients meet, so both APIs accept the same values
and refuse the rest with the same limits (errors name the OpenAI field).
"""

from __future__ import annotations

import json
import uuid
from typing import Annotated, Any

import msgspec
from msgspec import Meta

from actors.constraints import JSON_OPTIONS
from actors.tokenizer.intake import RequestError, decode_body
from protocol import messages as m
from protocol.config import LimitsConfig

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
          413: "invalid_request_error", 500: "server_error", 503: "server_overloaded"}


def error_body(status: int, message: str, param: str | None) -> dict[str, Any]:
    return {"error": {"message": message, "type": _TYPES.get(status, "server_error"),
                      "param": param, "code": status}}


class JsonSchemaFormat(msgspec.Struct, kw_only=True):
    name: str = ""
    description: str = ""
    schema: dict[str, Any] | None = None
    strict: bool | None = None


class ResponseFormat(msgspec.Struct, kw_only=True):
    """OpenAI's response_format, and sglang's structural_tag form of it."""

    type: str
    json_schema: JsonSchemaFormat | None = None
    structures: list[dict[str, Any]] | None = None  # type structural_tag
    triggers: list[str] | None = None


class _Common(msgspec.Struct, kw_only=True):
    """Fields both endpoints take (OpenAI's, then the usual vLLM/sglang extras). Unknown fields
    are ignored, as OpenAI clients send some we have no use for (user, service_tier...). Only
    types here: the ranges are GenerateRequest's, checked when the request is built."""

    model: str = ""
    temperature: float = 1.0
    top_p: float = 1.0
    n: Annotated[int, Meta(ge=1, le=16)] = 1
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    top_k: Annotated[int, Meta(ge=-1)] = 0  # -1 (vLLM's "off") is our 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    response_format: ResponseFormat | None = None
    regex: str | None = None  # sglang's extras: the output matches this regex,
    ebnf: str | None = None  # or this grammar (Lark as llguidance reads it, or GBNF)


def _constraint(c: _Common) -> dict[str, str]:
    """The GenerateRequest's constraint fields for the body's response_format / regex / ebnf;
    RequestError naming the field when it is not one we take."""
    out = {k: v for k, v in (("regex", c.regex), ("ebnf", c.ebnf)) if v}
    f = c.response_format
    if f is None or f.type == "text":
        return out
    if f.type == "json_object":
        out["json_schema"] = '{"type": "object"}'
    elif f.type == "json_schema":
        if f.json_schema is None or f.json_schema.schema is None:
            raise RequestError("response_format: type json_schema needs json_schema.schema",
                               param="response_format")
        out["json_schema"] = json.dumps(f.json_schema.schema)
    elif f.type == "structural_tag":
        out["structural_tag"] = json.dumps({"structures": f.structures or [],
                                            "triggers": f.triggers or []})
    else:
        raise RequestError(f"response_format: type {f.type[:40]!r} is not one of text, "
                           "json_object, json_schema, structural_tag", param="response_format")
    if len(out) > 1:
        raise RequestError(f"give one of response_format, regex and ebnf, not "
                           f"{' and '.join(sorted(out))}", param="response_format")
    return out


class CompletionBody(_Common, kw_only=True):
    # text, token ids, or a list of prompts: [text, ...] or [[ids], ...] (msgspec takes one
    # list type: the items are checked in _prompts)
    prompt: str | list[Any]
    max_tokens: int | None = 16
    logprobs: Annotated[int, Meta(ge=0, le=20)] | None = None
    echo: bool = False  # the prompt before the completion, in the text and the logprobs
    prompt_logprobs: Annotated[int, Meta(ge=0, le=20)] | None = None  # vLLM's extra


class ContentPart(msgspec.Struct):
    type: str
    text: str | None = None


class ChatMessageBody(msgspec.Struct):
    role: str
    content: str | list[ContentPart] | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    name: str | None = None
    reasoning_content: str | None = None  # an earlier reply's, sent back (for the template)


class FunctionBody(msgspec.Struct):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolBody(msgspec.Struct):
    type: str
    function: FunctionBody


class ChatBody(_Common, kw_only=True):
    messages: list[ChatMessageBody]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[ToolBody] | None = None
    # "auto" (the default with tools), "none", "required", or {"type": "function",
    # "function": {"name": ...}}.
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True


# GenerateRequest's field -> the OpenAI field a client set it with, for error messages.
_COMPLETION_NAMES = {"max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens",
                     "top_logprobs": "logprobs", "input_ids": "prompt"}
_CHAT_NAMES = {"min_new_tokens": "min_tokens"}


def _build(fields: dict[str, Any], names: dict[str, str]) -> m.GenerateRequest:
    """The wire schema's own validation, with the error naming the client's field."""
    try:
        return msgspec.convert(fields, m.GenerateRequest)
    except msgspec.ValidationError as e:
        message = str(e)
        path = message.rsplit("$.", 1)
        field = path[1].split("[")[0].rstrip("`") if len(path) > 1 else None
        param = names.get(field, field) if field else None
        if field and param != field:
            message = message.replace(f"$.{field}", f"$.{param}")
        raise RequestError(f"invalid request: {message}", param=param) from None


def _requests(c: _Common, max_new: int | None, prompts: list[dict[str, Any]], logprobs: bool,
              top: int, names: dict[str, str]) -> tuple[list[m.GenerateRequest], dict[str, Any]]:
    """n requests per prompt, prompt after prompt: request k is prompt k // n's choice
    k % n (OpenAI's and vLLM's choice index)."""
    stops = [c.stop] if isinstance(c.stop, str) else list(c.stop or [])
    try:
        bias = {int(k): v for k, v in (c.logit_bias or {}).items()}
    except ValueError:
        raise RequestError("logit_bias keys must be token ids", param="logit_bias") from None
    base = "http-" + uuid.uuid4().hex[:16]
    constraint = _constraint(c)
    reqs = [_build(dict(
        req_id=f"{base}-{p * c.n + k}", **prompt, max_new_tokens=max_new,
        temperature=c.temperature,
        top_p=c.top_p, top_k=max(c.top_k, 0), min_p=c.min_p,
        repetition_penalty=c.repetition_penalty, frequency_penalty=c.frequency_penalty,
        presence_penalty=c.presence_penalty, logit_bias=bias,
        # n choices of one seeded request: each reproducible, all different.
        seed=None if c.seed is None else c.seed + k, stop=stops,
        stop_token_ids=list(c.stop_token_ids or []), ignore_eos=c.ignore_eos,
        min_new_tokens=c.min_tokens, logprobs=logprobs, top_logprobs=top, stream=c.stream,
        group=f"{base}-{p}" if c.n > 1 else "", **constraint), names)
        for p, prompt in enumerate(prompts) for k in range(c.n)]
    include_usage = bool((c.stream_options or {}).get("include_usage"))
    return reqs, {"stream": c.stream, "include_usage": include_usage, "logprobs": logprobs,
                  "model": c.model, "n": c.n}


def parse_completion(raw: bytes, limits: LimitsConfig) -> tuple[list[m.GenerateRequest], dict]:
    c = decode_body(raw, CompletionBody, limits)
    prompts = _prompts(c.prompt, limits)
    if len(prompts) * c.n > limits.max_choices:
        raise RequestError(f"{len(prompts)} prompts x n={c.n} is {len(prompts) * c.n} choices; "
                           f"the server takes {limits.max_choices} (limits.max_choices)",
                           param="n")
    scored = c.echo and c.logprobs is not None or c.prompt_logprobs is not None
    # max_tokens 0 scores the prompt alone (with echo, as vLLM): one token is computed, as
    # the prompt's last logits are, and left out of the reply.
    score_only = c.max_tokens == 0
    if score_only and not c.echo:
        raise RequestError("max_tokens must be at least 1 (0 only with echo: the prompt "
                           "scored alone)", param="max_tokens")
    extra = {"echo": c.echo, "logprob_start_len": 0 if scored else -1}
    top = max(c.logprobs or 0, c.prompt_logprobs or 0)
    max_new = 1 if score_only else (16 if c.max_tokens is None else c.max_tokens)
    reqs, opts = _requests(c, max_new, [{**p, **extra} for p in prompts],
                           c.logprobs is not None or scored, top, _COMPLETION_NAMES)
    opts.update(echo=c.echo, score_only=score_only, top=c.logprobs or 0,
                prompt_logprobs=c.prompt_logprobs, prompts=len(prompts),
                logprobs=c.logprobs is not None)
    return reqs, opts


def _prompts(value: str | list[Any], limits: LimitsConfig) -> list[dict[str, Any]]:
    """A completion's prompts: a string, token ids, or a list of strings or of token-id
    lists; each as GenerateRequest's prompt or input_ids."""
    def ids(x: Any) -> bool:
        return isinstance(x, list) and all(isinstance(t, int) and not isinstance(t, bool)
                                           for t in x)
    if isinstance(value, str):
        return [{"prompt": value}]
    if value and ids(value):
        return [{"input_ids": value}]
    if not value:
        raise RequestError("prompt must not be empty", param="prompt")
    if len(value) > limits.max_prompts:
        raise RequestError(f"{len(value)} prompts in one request; the server takes "
                           f"{limits.max_prompts} (limits.max_prompts)", param="prompt")
    out = []
    for i, p in enumerate(value):
        if isinstance(p, str):
            out.append({"prompt": p})
        elif ids(p) and p:
            out.append({"input_ids": p})
        else:
            raise RequestError(f"prompt[{i}] must be a string or a non-empty list of token "
                               "ids", param="prompt")
    return out


def _content(msg: ChatMessageBody) -> str:
    """A message's text: a string, or its text content parts joined (this server is text only,
    so any other part is refused rather than silently dropped)."""
    if not isinstance(msg.content, list):
        return msg.content or ""
    for part in msg.content:
        if part.type != "text":
            raise RequestError(f"messages: content part type {part.type[:40]!r} is not "
                               "supported (text only)", param="messages")
        if part.text is None:
            raise RequestError("messages: a text content part needs a string `text`",
                               param="messages")
    return "".join(part.text for part in msg.content)


def parse_chat(raw: bytes, limits: LimitsConfig) -> tuple[list[m.GenerateRequest], dict]:
    return chat_requests(decode_body(raw, ChatBody, limits))


def chat_requests(c: ChatBody, session: str = "",
                  names: dict[str, str] | None = None) -> tuple[list[m.GenerateRequest], dict]:
    """A chat body's requests: the one path every chat-shaped API (chat completions, Anthropic
    messages, OpenAI responses) takes to the graph, so one conversation gives one prompt.
    names: GenerateRequest's fields -> the caller's API fields, for error messages."""
    messages = _messages(c.messages)
    if not messages:
        raise RequestError("messages must not be empty", param="messages")
    names = names or dict(_CHAT_NAMES, max_new_tokens="max_completion_tokens"
                          if c.max_completion_tokens is not None else "max_tokens")
    max_new = next((v for v in (c.max_completion_tokens, c.max_tokens) if v is not None), 4096)
    prompt: dict[str, Any] = {"messages": messages,
                              "chat_template_kwargs": c.chat_template_kwargs or {}}
    choice = _tool_choice(c)
    if c.tools:
        prompt["tools"] = [msgspec.to_builtins(t) for t in c.tools]
    if choice not in ("auto", "none"):
        if c.response_format is not None or c.regex or c.ebnf:
            raise RequestError("tool_choice required or a named function already constrains "
                               "the reply: give no response_format, regex or ebnf with it",
                               param="tool_choice")
        prompt["ebnf"] = tool_grammar(c.tools, None if choice == "required" else choice,
                                      c.parallel_tool_calls)
    if session:
        prompt["session"] = session
    reqs, opts = _requests(c, max_new, [prompt], c.logprobs, c.top_logprobs or 0, names)
    opts["tools"] = bool(c.tools) and choice != "none"
    return reqs, opts


def _tool_choice(c: ChatBody) -> str:
    """"auto", "none", "required", or the name of the function the reply must call."""
    choice = c.tool_choice if c.tool_choice is not None else "auto"
    for t in c.tools or []:
        if t.type != "function":
            raise RequestError(f"tools: type {t.type[:40]!r} is not supported (function only)",
                               param="tools")
    if isinstance(choice, dict):
        name = (choice.get("function") or {}).get("name") \
            if isinstance(choice.get("function"), dict) else None
        if choice.get("type") != "function" or not isinstance(name, str):
            raise RequestError('tool_choice: give "auto", "none", "required" or {"type": '
                               '"function", "function": {"name": ...}}', param="tool_choice")
        if name not in {t.function.name for t in c.tools or []}:
            raise RequestError(f"tool_choice: no function {name[:60]!r} in tools",
                               param="tool_choice")
        return name
    if choice not in ("auto", "none", "required"):
        raise RequestError(f"tool_choice: {str(choice)[:40]!r} is not one of auto, none, "
                           "required or a named function", param="tool_choice")
    if choice == "required" and not c.tools:
        raise RequestError("tool_choice required needs tools", param="tool_choice")
    return choice


def tool_grammar(tools: list[ToolBody], name: str | None, parallel: bool) -> str:
    """The Lark grammar (llguidance's, with %json) of a reply made of tool calls in Qwen's
    format: one, or with `parallel` one or more, of any function, or of `name` only. The
    arguments follow the function's parameters schema."""
    calls = [{"type": "object", "properties": {
                "name": {"const": t.function.name},
                "arguments": t.function.parameters or {"type": "object"}},
              "required": ["name", "arguments"], "additionalProperties": False}
             for t in tools if name is None or t.function.name == name]
    # %json in a Lark grammar takes its JSON options from the schema: those of every schema.
    schema = {"x-guidance": JSON_OPTIONS, **(calls[0] if len(calls) == 1 else {"anyOf": calls})}
    start = 'start: call ("\\n" call)*' if parallel else "start: call"
    return "\n".join([start, 'call: <tool_call> "\\n" body "\\n" </tool_call>',
                      f"body: %json {json.dumps(schema)}"])


class TokenizeBody(msgspec.Struct, kw_only=True):
    """POST /tokenize, as vLLM serves it (vllm-router asks each worker for the prompt's
    tokens to route by them): a prompt or chat messages."""

    model: str = ""
    prompt: str | None = None
    messages: list[ChatMessageBody] | None = None
    chat_template_kwargs: dict[str, Any] | None = None


def parse_tokenize(raw: bytes, limits: LimitsConfig) -> m.GenerateRequest:
    """The request whose prompt tokens /tokenize answers with: they are tokenized as a
    generate request's are (Frontend.tokenize)."""
    body = decode_body(raw, TokenizeBody, limits)
    if (body.prompt is None) == (body.messages is None):
        raise RequestError("give one of prompt or messages", param="prompt")
    return m.GenerateRequest(req_id="tokenize", prompt=body.prompt or "",
                             messages=_messages(body.messages or []),
                             chat_template_kwargs=body.chat_template_kwargs or {})


def _messages(bodies: list[ChatMessageBody]) -> list[m.ChatMessage]:
    return [m.ChatMessage(role=msg.role, content=_content(msg),
                          tool_calls=msg.tool_calls or [], tool_call_id=msg.tool_call_id or "",
                          name=msg.name or "", reasoning_content=msg.reasoning_content or "")
            for msg in bodies]
