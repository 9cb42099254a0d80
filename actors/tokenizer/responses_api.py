"""OpenAI's Responses API routes: POST /v1/responses (through the relay, as /v1/messages),
GET and DELETE /v1/responses/{id} on the response store."""

from __future__ import annotations

from typing import Any, Callable

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from actors.tokenizer.http_relay import relay
from actors.tokenizer.intake import RequestError
from actors.tokenizer.response_store import ResponseStore
from actors.tokenizer.responses_format import parse_responses
from actors.tokenizer.responses_replies import ResponseWriter
from protocol import messages as m


def responses_routes(bridge: Any, guarded: Callable, body: Callable,
                     session: Callable[[Request], str], check_model: Callable) -> list[Route]:
    store = ResponseStore(bridge.store_items, bridge.store_bytes)

    def history(response_id: str) -> list | None:
        entry = store.get(response_id)
        return None if entry is None else entry.conversation

    async def create(request: Request) -> Response:
        parsed = parse_responses(await body(request, bridge.limits), bridge.limits,
                                 history=history, session=session(request))
        check_model({"model": parsed.body.model})
        writer = ResponseWriter(bridge.model_name, parsed)

        def keep(fin: m.Finished) -> None:
            if parsed.body.store:
                store.put(writer.response, [*parsed.conversation, writer.message])
        return await relay(bridge, request, parsed.req, writer, done=keep)

    def missing(response_id: str) -> RequestError:
        return RequestError(f"no stored response {response_id[:80]!r}", 404,
                            param="response_id")

    async def get(request: Request) -> Response:
        entry = store.get(request.path_params["response_id"])
        if entry is None:
            raise missing(request.path_params["response_id"])
        return JSONResponse(entry.response)

    async def delete(request: Request) -> Response:
        response_id = request.path_params["response_id"]
        if not store.delete(response_id):
            raise missing(response_id)
        return JSONResponse({"id": response_id, "object": "response", "deleted": True})

    return [Route("/v1/responses", guarded(create), methods=["POST"]),
            Route("/v1/responses/{response_id}", guarded(get), methods=["GET"]),
            Route("/v1/responses/{response_id}", guarded(delete), methods=["DELETE"])]
