"""The HTTP API (OpenAI's completions, chat and responses, Anthropic's messages): an ASGI app
(Starlette under uvicorn) in the tokenizer actor's event loop. Every request becomes
GenerateRequests for the same Frontend the ZMQ clients use; replies come back on a queue per
HTTP request instead of the ROUTER socket."""

from __future__ import annotations

import asyncio
import hmac
import time
import uuid
from typing import Any, AsyncIterator, Callable, Protocol

import msgspec
import structlog
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from actors.tokenizer.anthropic_format import parse_count, parse_messages
from actors.tokenizer.anthropic_replies import MessageWriter
from actors.tokenizer.anthropic_replies import error_body as anthropic_error_body
from actors.tokenizer.chat_output import ChatOutput, finish_reason
from actors.tokenizer.event_stream import EventStream, disconnected, raw_send_app
from actors.tokenizer.http_relay import Bridge as RelayBridge
from actors.tokenizer.http_relay import peer, relay
from actors.tokenizer.intake import RequestError
from actors.tokenizer.openai_format import (error_body, parse_chat, parse_completion,
                                            parse_tokenize)
from actors.tokenizer.openai_replies import (chat_chunk, chat_response, choice_of,
                                             completion_chunk, completion_response, prompt_of,
                                             usage)
from actors.tokenizer.responses_api import responses_routes
from protocol import messages as m
from protocol.config import LimitsConfig


class Bridge(RelayBridge, Protocol):
    """What the HTTP app needs from the actor that hosts it (submit, abort, prompt_tokens and
    internal_error: the relay's)."""

    model_name: str
    strict_model_name: bool  # a request for another model is a 404 (else served)
    context_length: int
    api_key: str
    limits: LimitsConfig
    store_items: int  # the response store's bounds (server.response_store_*)
    store_bytes: int

    async def healthy(self) -> bool: ...
    def metrics(self) -> str: ...
    def token_text(self, token_id: int) -> str: ...
    def server_info(self) -> dict[str, Any]: ...
    def tokenize(self, req: m.GenerateRequest) -> list[int]: ...


def build_app(bridge: Bridge) -> Any:
    def guarded(handler: Callable, shape: Callable[..., JSONResponse] | None = None) -> Callable:
        """The route with the API key checked and every failure answered in its API's shape
        (OpenAI's by default)."""
        answer = shape or _error

        async def route(request: Request) -> Response:
            if bridge.api_key and not _authorized(request, bridge.api_key):
                return answer(401, "invalid or missing API key (Authorization: Bearer ... or "
                              "x-api-key)")
            try:
                return await handler(request)
            except RequestError as e:
                if not e.logged:
                    structlog.get_logger().warning("http.rejected", path=request.url.path,
                                                   peer=peer(request), code=e.code,
                                                   error=e.message[:300])
                return answer(e.code, e.message, e.param)
            except Exception as e:  # a bug: the request fails alone, counted, logged
                bridge.internal_error()
                structlog.get_logger().warning("http.internal_error", path=request.url.path,
                                               peer=peer(request), error=repr(e)[:300],
                                               exc_info=True)
                return answer(500, f"internal error: {type(e).__name__}")
        return route

    def check_model(opts: dict[str, Any]) -> None:
        # vLLM's rule with strict names; else any name is served (clients set up for
        # another provider send theirs).
        if bridge.strict_model_name and opts["model"] != bridge.model_name:
            raise RequestError(f"the model {opts['model'][:200]!r} does not exist; this server "
                               f"serves {bridge.model_name!r}", 404, param="model")

    async def completions(request: Request) -> Response:
        reqs, opts = parse_completion(await _body(request, bridge.limits), bridge.limits)
        check_model(opts)
        if opts["prompts"] > 1:
            _check_total(bridge, reqs[::opts["n"]])
        opts["token_text"] = bridge.token_text
        return await _serve(bridge, request, reqs, opts, chat=False)

    async def chat(request: Request) -> Response:
        reqs, opts = parse_chat(await _body(request, bridge.limits), bridge.limits)
        check_model(opts)
        opts["token_text"] = bridge.token_text
        return await _serve(bridge, request, reqs, opts, chat=True)

    async def messages(request: Request) -> Response:
        req, opts = parse_messages(await _body(request, bridge.limits), bridge.limits,
                                   session=_session(request))
        check_model(opts)
        writer = MessageWriter(bridge.model_name, opts["tools"], opts["omit_thinking"])
        return await relay(bridge, request, req, writer)

    async def count_tokens(request: Request) -> Response:
        req = parse_count(await _body(request, bridge.limits), bridge.limits)
        return JSONResponse({"input_tokens": len(bridge.tokenize(req))})

    async def models(request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [
            {"id": bridge.model_name, "object": "model", "created": 0,
             "owned_by": "mlx-actor-serve"}]})

    async def health(request: Request) -> Response:
        ok = await bridge.healthy()
        return PlainTextResponse("ok" if ok else "unhealthy", status_code=200 if ok else 503)

    async def metrics(request: Request) -> Response:
        return PlainTextResponse(bridge.metrics(), media_type="text/plain; version=0.0.4")

    async def server_info(request: Request) -> Response:
        # sglang-router reads served_model_name from here (sglang's own route names).
        return JSONResponse(bridge.server_info())

    async def tokenize(request: Request) -> Response:
        ids = bridge.tokenize(parse_tokenize(await _body(request, bridge.limits), bridge.limits))
        return JSONResponse({"count": len(ids), "max_model_len":
                             bridge.context_length, "tokens": ids})

    return raw_send_app(Starlette(routes=[
        Route("/v1/completions", guarded(completions), methods=["POST"]),
        Route("/v1/chat/completions", guarded(chat), methods=["POST"]),
        Route("/v1/messages", guarded(messages, _anthropic_error), methods=["POST"]),
        Route("/v1/messages/count_tokens", guarded(count_tokens, _anthropic_error),
              methods=["POST"]),
        *responses_routes(bridge, guarded, _body, _session, check_model),
        Route("/v1/models", guarded(models), methods=["GET"]),
        Route("/metrics", guarded(metrics), methods=["GET"]),
        Route("/server_info", guarded(server_info), methods=["GET"]),
        Route("/get_server_info", guarded(server_info), methods=["GET"]),
        Route("/tokenize", guarded(tokenize), methods=["POST"]),
        Route("/health", health, methods=["GET"]),
    ]))


async def _body(request: Request, limits: LimitsConfig) -> bytes:
    """The raw body, read no further than limits.max_body_bytes."""
    too_big = RequestError(f"the body is over limits.max_body_bytes ({limits.max_body_bytes})",
                           413)
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limits.max_body_bytes:
        raise too_big
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limits.max_body_bytes:
            raise too_big
        chunks.append(chunk)
    return b"".join(chunks)


def _authorized(request: Request, key: str) -> bool:
    """OpenAI's clients send the key as a bearer token, Anthropic's as x-api-key. Compared as
    bytes: a header may hold any latin-1 character, which compare_digest refuses in a str."""
    want = key.encode()
    given = [request.headers.get("authorization", "").encode("latin-1", "replace"),
             request.headers.get("x-api-key", "").encode("latin-1", "replace")]
    return hmac.compare_digest(given[0], b"Bearer " + want) or \
        hmac.compare_digest(given[1], want)


# Headers that name an agent's session (Claude Code's, Codex's, a generic one).
SESSION_HEADERS = ("x-claude-code-session-id", "session-id", "session_id", "x-session-id")


def _session(request: Request) -> str:
    return next((v for h in SESSION_HEADERS if (v := request.headers.get(h))), "")[:256]


def _error(status: int, message: str, param: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param), status_code=status)


def _anthropic_error(status: int, message: str, param: str | None = None) -> JSONResponse:
    return JSONResponse(anthropic_error_body(status, message), status_code=status)


async def _serve(bridge: Bridge, request: Request, reqs: list[m.GenerateRequest],
                 opts: dict[str, Any], chat: bool) -> Response:
    # One queue for the n choices: replies carry their req_id, which names the choice.
    queue: asyncio.Queue = asyncio.Queue()
    index = {r.req_id: k for k, r in enumerate(reqs)}
    for r in reqs:
        bridge.submit(r, queue, peer(request))
    rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
    created = int(time.time())
    # Until the reply starts, a client that leaves (during a long prefill, say) is found by
    # waiting on the disconnect message; once a stream runs, EventStream does.
    watch = asyncio.ensure_future(_watch_disconnect(request, bridge, reqs))
    if opts["stream"]:
        try:
            first = await queue.get()
        finally:
            watch.cancel()
        # An error in the first reply (validation, overload) is an HTTP error, not a stream.
        if isinstance(first, m.ErrorReply):
            for r in reqs:
                bridge.abort(r.req_id)
            raise RequestError(_which(first, index, opts), first.code, logged=True)
        body = _stream(bridge, reqs, index, queue, first, opts, chat, rid, created)
        return EventStream(body)
    results: dict[int, m.Finished] = {}
    try:
        while len(results) < len(reqs):
            reply = await queue.get()
            if isinstance(reply, m.ErrorReply):
                for r in reqs:
                    bridge.abort(r.req_id)
                raise RequestError(_which(reply, index, opts), reply.code, logged=True)
            if isinstance(reply, m.Finished):
                results[index[reply.req_id]] = reply
    finally:
        watch.cancel()
    ordered = [results[k] for k in range(len(reqs))]
    choices = [choice_of(k, r, opts) for k, r in enumerate(ordered)]
    build = chat_response if chat else completion_response
    return JSONResponse(build(rid, created, bridge.model_name, choices, _usage(ordered, opts),
                              opts))


def _check_total(bridge: Bridge, prompts: list[m.GenerateRequest]) -> None:
    """Several prompts in one request: their tokens together within limits.max_request_tokens
    (each prompt's own errors are named when it is tokenized for the graph)."""
    limit = bridge.limits.max_request_tokens
    # A byte-level BPE token holds at least one byte of UTF-8: prompts whose bytes fit are
    # not tokenized here (they are once more on their way to the graph).
    if sum(len(r.input_ids) or len(r.prompt.encode()) for r in prompts) <= limit:
        return
    total = 0
    for r in prompts:
        try:
            total += len(r.input_ids) if r.input_ids else len(bridge.tokenize(r))
        except RequestError:
            return  # that prompt fails the request with its own message
    if total > limit:
        raise RequestError(f"the prompts hold {total} tokens together; the server takes "
                           f"{limit} per request (limits.max_request_tokens)", param="prompt")


def _usage(results: list[m.Finished], opts: dict[str, Any]) -> dict[str, Any]:
    return usage(results, opts.get("n", 1), opts.get("score_only", False))


def _which(reply: m.ErrorReply, index: dict[str, int], opts: dict[str, Any]) -> str:
    """An error of one of several prompts fails the request, naming the prompt."""
    if opts.get("prompts", 1) < 2 or reply.req_id not in index:
        return reply.message
    return f"prompt[{index[reply.req_id] // opts['n']}]: {reply.message}"


async def _watch_disconnect(request: Request, bridge: Bridge,
                            reqs: list[m.GenerateRequest]) -> None:
    """A client that goes away mid-request: abort, so its row and slots are freed. (Polling
    every 0.2 s here doubled the tokenizer's CPU per output token with 256 clients queued.)"""
    await disconnected(request.receive)
    for r in reqs:
        bridge.abort(r.req_id)


async def _stream(bridge: Bridge, reqs: list[m.GenerateRequest], index: dict[str, int],
                  queue: asyncio.Queue, first: Any, opts: dict[str, Any], chat: bool, rid: str,
                  created: int) -> AsyncIterator[bytes]:
    model = bridge.model_name
    score_only = opts.get("score_only", False)
    finals: dict[int, m.Finished] = {}
    reply = first
    # A chat choice's text is split into reasoning, content and tool calls as it comes.
    parsers = {k: ChatOutput(reasoning=True, tools=opts.get("tools", False))
               for k in range(len(reqs))} if chat else {}

    def chunks(k: int, text: str, reason: str | None, lp: Any,
               prompt: dict[str, Any] | None = None) -> list[bytes]:
        if not chat:
            return [_sse(completion_chunk(rid, created, model, k, text, reason, lp, opts,
                                          prompt))]
        parser = parsers[k]
        deltas = parser.feed(text) if reason is None else parser.finish()
        if reason is not None:
            reason = finish_reason(reason, bool(parser.calls))
        if lp is not None or reason is not None:
            deltas = deltas or [{}]  # logprobs and the finish ride on a chunk of their own
        last = len(deltas) - 1
        return [_sse(chat_chunk(rid, created, model, k, d, reason if i == last else None,
                                lp if i == 0 else None, opts)) for i, d in enumerate(deltas)]

    # Events already here go out as one write: a request's last token, its finish, its usage
    # and [DONE] usually arrive together, and each write is a packet the client parses alone.
    parts: list[bytes] = []
    try:
        if chat:
            for k in range(len(reqs)):
                parts.append(_sse(chat_chunk(rid, created, model, k,
                                             {"role": "assistant", "content": ""}, None, None,
                                             opts)))
        while True:
            if isinstance(reply, m.ErrorReply):  # the server failed mid-stream
                parts.append(_sse(error_body(reply.code, reply.message, None)))
                break
            k = index[reply.req_id]
            prompt = None if chat else prompt_of(reply)
            if prompt is not None:  # echo / prompt logprobs: the prompt goes first
                parts += chunks(k, "", None, None, prompt)
            if isinstance(reply, m.Delta) and (reply.token_ids or reply.text) and not score_only:
                lp = (reply.token_ids, reply.logprobs, reply.top_ids, reply.top_logprobs)
                parts += chunks(k, reply.text, None, lp if opts["logprobs"] else None)
            if isinstance(reply, m.Finished):
                finals[k] = reply
                if score_only:
                    parts += chunks(k, "", "length", None)
                else:
                    parts += chunks(k, reply.text, reply.finish_reason, None)
                if len(finals) == len(reqs):
                    break
            if parts and queue.empty():
                yield b"".join(parts)
                parts = []
            reply = await queue.get()
        if opts.get("include_usage") and len(finals) == len(reqs):
            parts.append(_sse({"id": rid, "object": "chat.completion.chunk" if chat
                               else "text_completion", "created": created, "model": model,
                               "choices": [],
                               "usage": _usage([finals[k] for k in sorted(finals)], opts)}))
        parts.append(b"data: [DONE]\n\n")
        yield b"".join(parts)
    except Exception as e:  # a bug of ours: this stream ends with an error event, counted
        bridge.internal_error()
        structlog.get_logger().warning("http.stream_failed", error=repr(e)[:300], exc_info=True)
        yield _sse(error_body(500, f"internal error: {type(e).__name__}", None))
    finally:
        for k, r in enumerate(reqs):
            if k not in finals:
                bridge.abort(r.req_id)  # the client went away mid-stream


def _sse(obj: Any) -> bytes:
    return b"data: " + msgspec.json.encode(obj) + b"\n\n"
