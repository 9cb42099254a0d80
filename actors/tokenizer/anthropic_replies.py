"""A reply as Anthropic's Messages API gives it: the message object, its stream of events
(message_start, content_block_start / _delta / _stop, message_delta, message_stop, ping),
and errors in Anthropic's shape. Pure: no sockets, no event loop. The request side:
anthropic_format.py.

The reply's text is split by the same ChatOutput chat completions uses; its deltas
(reasoning, content, tool calls) open and fill content blocks in order: thinking, text,
tool_use. A streamed reply and a whole one go through the same blocks, so the content a
client assembles from the events is the content a non-streamed reply holds.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

import msgspec

from actors.tokenizer.chat_output import sign
from actors.tokenizer.chat_output import ChatOutput
from actors.tokenizer.http_relay import sse
from protocol import messages as m

# HTTP status -> Anthropic's error type.
_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
          500: "api_error", 503: "overloaded_error", 529: "overloaded_error"}


def error_body(status: int, message: str) -> dict[str, Any]:
    return {"type": "error", "error": {"type": _TYPES.get(status, "api_error"),
                                       "message": message}}


def usage(prompt_tokens: int, cached: int, output: int) -> dict[str, int]:
    """Anthropic counts the prompt's tokens read from the cache apart from input_tokens."""
    return {"input_tokens": prompt_tokens - cached, "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": cached, "output_tokens": output}


def stop_reason(fin: m.Finished, called: bool) -> str:
    if fin.finish_reason == "length":
        return "max_tokens"
    if called:
        return "tool_use"
    return "stop_sequence" if fin.stop_str else "end_turn"


class MessageWriter:
    """One reply as a message (relay's ReplyWriter)."""

    def __init__(self, model: str, tools: bool, omit_thinking: bool = False):
        self.model, self.omit_thinking = model, omit_thinking
        self.id = "msg_" + uuid.uuid4().hex[:24]
        self.parser = ChatOutput(reasoning=True, tools=tools)
        self.content: list[dict[str, Any]] = []  # the blocks so far
        self.open = ""  # the type of the block being filled ("" when none is)
        self.thought = ""  # the open thinking block's text (its signature is made of it)
        self.args = ""  # the open tool_use block's input, as JSON text

    # -- streamed ----------------------------------------------------------------------------

    def begin(self, prompt_tokens: int) -> list[bytes]:
        message = {"id": self.id, "type": "message", "role": "assistant", "model": self.model,
                   "content": [], "stop_reason": None, "stop_sequence": None,
                   "usage": usage(prompt_tokens, 0, 0)}
        return [_event("message_start", {"message": message}), _event("ping", {})]

    def keepalive(self) -> bytes:
        return _event("ping", {})

    def text(self, piece: str) -> list[bytes]:
        return self._blocks(self.parser.feed(piece))

    def end(self, fin: m.Finished) -> list[bytes]:
        events = self._blocks(self.parser.finish()) + self._close()
        delta = {"stop_reason": stop_reason(fin, bool(self.parser.calls)),
                 "stop_sequence": fin.stop_str or None}
        return events + [
            _event("message_delta", {"delta": delta, "usage": usage(
                fin.prompt_tokens, fin.cached_tokens, fin.completion_tokens)}),
            _event("message_stop", {})]

    def failed(self, code: int, message: str) -> list[bytes]:
        return [_event("error", {"error": error_body(code, message)["error"]})]

    # -- whole -------------------------------------------------------------------------------

    def whole(self, fin: m.Finished) -> dict[str, Any]:
        self._blocks(self.parser.feed(fin.text) + self.parser.finish())
        self._close()
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model,
                "content": self.content,
                "stop_reason": stop_reason(fin, bool(self.parser.calls)),
                "stop_sequence": fin.stop_str or None,
                "usage": usage(fin.prompt_tokens, fin.cached_tokens, fin.completion_tokens)}

    # -- blocks ------------------------------------------------------------------------------

    def _blocks(self, deltas: list[dict[str, Any]]) -> list[bytes]:
        """ChatOutput deltas -> the events of the blocks they open and fill."""
        events: list[bytes] = []
        for d in deltas:
            if "reasoning_content" in d:
                if self.open != "thinking":
                    events += self._start({"type": "thinking", "thinking": "", "signature": ""})
                self.thought += d["reasoning_content"]
                if not self.omit_thinking:
                    self.content[-1]["thinking"] += d["reasoning_content"]
                    events.append(self._delta({"type": "thinking_delta",
                                               "thinking": d["reasoning_content"]}))
            elif "content" in d:
                if self.open != "text":
                    events += self._start({"type": "text", "text": ""})
                self.content[-1]["text"] += d["content"]
                events.append(self._delta({"type": "text_delta", "text": d["content"]}))
            elif "tool_calls" in d:
                call = d["tool_calls"][0]
                if "id" in call:  # a call's head: a new block
                    events += self._start({"type": "tool_use",
                                           "id": "toolu_" + call["id"].removeprefix("call_"),
                                           "name": call["function"]["name"], "input": {}})
                piece = call["function"]["arguments"]
                if piece:
                    self.args += piece
                    events.append(self._delta({"type": "input_json_delta",
                                               "partial_json": piece}))
        return events

    def _start(self, block: dict[str, Any]) -> list[bytes]:
        events = self._close()
        self.open = block["type"]
        self.content.append(dict(block))
        return events + [_event("content_block_start", {"index": len(self.content) - 1,
                                                        "content_block": block})]

    def _delta(self, delta: dict[str, Any]) -> bytes:
        return _event("content_block_delta", {"index": len(self.content) - 1, "delta": delta})

    def _close(self) -> list[bytes]:
        """End the open block: a thinking block gets its signature, a tool_use block its
        input (the arguments as a value; {} where cut short by max_tokens)."""
        if not self.open:
            return []
        block, events = self.content[-1], []
        if self.open == "thinking":
            block["signature"] = sign(self.thought)
            events.append(self._delta({"type": "signature_delta",
                                       "signature": block["signature"]}))
            self.thought = ""
        elif self.open == "tool_use":
            try:
                value = json.loads(self.args or "{}")
            except ValueError:
                value = {}
            block["input"] = value if isinstance(value, dict) else {}
            self.args = ""
        self.open = ""
        return events + [_event("content_block_stop", {"index": len(self.content) - 1})]


def _event(name: str, fields: dict[str, Any]) -> bytes:
    return sse(name, msgspec.json.encode({"type": name, **fields}))
