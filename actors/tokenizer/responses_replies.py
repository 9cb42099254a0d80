"""A reply as OpenAI's Responses API gives it: the response object with its output items
(reasoning, message, function_call), and its stream of events, each with a sequence_number
(response.created, .in_progress, .output_item.added / .done, .content_part.added / .done,
.output_text.delta / .done, .reasoning_text.delta / .done, .function_call_arguments.delta /
.done, then .completed, .incomplete or .failed). Pure: no sockets, no event loop.

The reply's text is split by the same ChatOutput chat completions uses; its deltas open and
fill output items in order, streamed or whole alike.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

import msgspec

from actors.tokenizer.chat_output import sign
from actors.tokenizer.chat_output import ChatOutput
from actors.tokenizer.http_relay import sse
from actors.tokenizer.openai_format import ChatMessageBody
from actors.tokenizer.responses_format import ENCRYPTED_REASONING, Parsed, reply_tool_call
from protocol import messages as m


def _id(prefix: str) -> str:
    return prefix + uuid.uuid4().hex[:24]


def usage(fin: m.Finished) -> dict[str, Any]:
    return {"input_tokens": fin.prompt_tokens,
            "input_tokens_details": {"cached_tokens": fin.cached_tokens},
            "output_tokens": fin.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": fin.prompt_tokens + fin.completion_tokens}


class ResponseWriter:
    """One reply as a response (relay's ReplyWriter). After the reply ends, `response` is
    the whole response object and `message` the assistant turn it adds to a conversation."""

    def __init__(self, model: str, parsed: Parsed):
        b = parsed.body
        self.parsed = parsed
        self.parser = ChatOutput(reasoning=True, tools=parsed.tools)
        self.sealed = ENCRYPTED_REASONING in (b.include or [])
        self.seq = 0
        self.output: list[dict[str, Any]] = []
        self.open = ""  # the type of the item being filled ("" when none is)
        self.called = ""  # the open call's function as the model named it (ns.name)
        self.response: dict[str, Any] = {
            "id": _id("resp_"), "object": "response", "created_at": int(time.time()),
            "status": "in_progress", "error": None, "incomplete_details": None,
            "instructions": b.instructions, "max_output_tokens": b.max_output_tokens,
            "model": model, "output": [], "parallel_tool_calls": b.parallel_tool_calls,
            "previous_response_id": b.previous_response_id,
            "reasoning": {"effort": b.reasoning.effort if b.reasoning else None,
                          "summary": b.reasoning.summary if b.reasoning else None},
            "store": b.store, "temperature": 1.0 if b.temperature is None else b.temperature,
            "text": {"format": msgspec.to_builtins(b.text.format)
                     if b.text and b.text.format else {"type": "text"}},
            "tool_choice": b.tool_choice if b.tool_choice is not None else "auto",
            "tools": b.tools or [], "top_p": 1.0 if b.top_p is None else b.top_p,
            "truncation": "disabled", "usage": None, "metadata": b.metadata or {},
            "user": None}
        self.message = ChatMessageBody(role="assistant", content="")

    @property
    def id(self) -> str:
        return self.response["id"]

    # -- streamed ----------------------------------------------------------------------------

    def begin(self, prompt_tokens: int) -> list[bytes]:
        snapshot = dict(self.response)
        return [self._event("response.created", response=snapshot),
                self._event("response.in_progress", response=snapshot)]

    def keepalive(self) -> bytes:
        return b": keepalive\n\n"  # an SSE comment: OpenAI's events have no ping

    def text(self, piece: str) -> list[bytes]:
        return self._items(self.parser.feed(piece))

    def end(self, fin: m.Finished) -> list[bytes]:
        events = self._items(self.parser.finish()) + self._close()
        self._settle(fin)
        kind = "response.completed" if self.response["status"] == "completed" \
            else "response.incomplete"
        return events + [self._event(kind, response=self.response)]

    def failed(self, code: int, message: str) -> list[bytes]:
        self.response.update(status="failed", output=self.output, error={
            "code": "server_error" if code >= 500 else "invalid_request", "message": message})
        return [self._event("response.failed", response=self.response)]

    # -- whole -------------------------------------------------------------------------------

    def whole(self, fin: m.Finished) -> dict[str, Any]:
        self._items(self.parser.feed(fin.text) + self.parser.finish())
        self._close()
        self._settle(fin)
        return self.response

    def _settle(self, fin: m.Finished) -> None:
        cut = fin.finish_reason == "length"
        self.response.update(
            status="incomplete" if cut else "completed", output=self.output, usage=usage(fin),
            incomplete_details={"reason": "max_output_tokens"} if cut else None)

    # -- items -------------------------------------------------------------------------------

    def _items(self, deltas: list[dict[str, Any]]) -> list[bytes]:
        events: list[bytes] = []
        for d in deltas:
            if "reasoning_content" in d:
                piece = d["reasoning_content"]
                if self.open != "reasoning":
                    events += self._add({"type": "reasoning", "id": _id("rs_"), "summary": [],
                                         "content": [{"type": "reasoning_text", "text": ""}]},
                                        part={"type": "reasoning_text", "text": ""})
                self._item["content"][0]["text"] += piece
                events.append(self._event("response.reasoning_text.delta", delta=piece,
                                          **self._at(part=True)))
            elif "content" in d:
                piece = d["content"]
                if self.open != "message":
                    events += self._add({"type": "message", "id": _id("msg_"),
                                         "status": "in_progress", "role": "assistant",
                                         "content": [{"type": "output_text", "text": "",
                                                      "annotations": [], "logprobs": []}]},
                                        part={"type": "output_text", "text": "",
                                              "annotations": [], "logprobs": []})
                self._item["content"][0]["text"] += piece
                events.append(self._event("response.output_text.delta", delta=piece,
                                          logprobs=[], **self._at(part=True)))
            elif "tool_calls" in d:
                call = d["tool_calls"][0]
                if "id" in call:  # a call's head: a new item
                    self.called = call["function"]["name"]
                    events += self._add({
                        "type": "function_call", "id": _id("fc_"), "call_id": call["id"],
                        **reply_tool_call(self.called, self.parsed.namespaces),
                        "arguments": "", "status": "in_progress"})
                piece = call["function"]["arguments"]
                if piece:
                    self._item["arguments"] += piece
                    events.append(self._event("response.function_call_arguments.delta",
                                              delta=piece, **self._at()))
        return events

    @property
    def _item(self) -> dict[str, Any]:
        return self.output[-1]

    def _at(self, part: bool = False) -> dict[str, Any]:
        at = {"item_id": self._item["id"], "output_index": len(self.output) - 1}
        return {**at, "content_index": 0} if part else at

    def _add(self, item: dict[str, Any], part: dict[str, Any] | None = None) -> list[bytes]:
        events = self._close()
        self.output.append(item)
        self.open = item["type"]
        added = item if item["type"] == "function_call" else {**item, "content": []}
        events.append(self._event("response.output_item.added", output_index=len(self.output)
                                  - 1, item=added))
        if part is not None:
            events.append(self._event("response.content_part.added", part=part,
                                      **self._at(part=True)))
        return events

    def _close(self) -> list[bytes]:
        """End the open item (its .done events), and add what it says to `message`."""
        if not self.open:
            return []
        item, events = self._item, []
        kind, self.open = self.open, ""
        if kind == "function_call":
            item["status"] = "completed"
            events.append(self._event("response.function_call_arguments.done",
                                      arguments=item["arguments"], name=item["name"],
                                      **self._at()))
            self.message.tool_calls = [*(self.message.tool_calls or []), {
                "id": item["call_id"], "type": "function",
                "function": {"name": self.called, "arguments": item["arguments"]}}]
        else:
            part = item["content"][0]
            done = "response.reasoning_text.done" if kind == "reasoning" \
                else "response.output_text.done"
            extra = {} if kind == "reasoning" else {"logprobs": []}
            events.append(self._event(done, text=part["text"], **extra, **self._at(part=True)))
            events.append(self._event("response.content_part.done", part=part,
                                      **self._at(part=True)))
            if kind == "reasoning":
                self.message.reasoning_content = (self.message.reasoning_content or "") + \
                    part["text"]
                if self.sealed:
                    item["encrypted_content"] = sign(part["text"])
            else:
                item["status"] = "completed"
                self.message.content = (self.message.content or "") + part["text"]
        events.append(self._event("response.output_item.done", output_index=len(self.output)
                                  - 1, item=item))
        return events

    def _event(self, kind: str, **fields: Any) -> bytes:
        data = msgspec.json.encode({"type": kind, "sequence_number": self.seq, **fields})
        self.seq += 1
        return sse(kind, data)
