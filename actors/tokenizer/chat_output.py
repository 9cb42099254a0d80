"""A chat reply's text, as it streams, split the way OpenAI clients read it: Qwen's
`<think>...</think>` as reasoning_content, `<tool_call>{"name": ..., "arguments": ...}</tool_call>`
blocks as tool_calls (their arguments in pieces as they come), and the rest as content.

One state machine serves both shapes of a reply: a streamed one feeds it every delta, a whole
one feeds it the whole text. So the arguments a client assembles from streamed deltas are the
very text a non-streamed reply holds (the model's own JSON, not a re-serialization of it).
"""

from __future__ import annotations

import base64
import json
import re
import uuid
from typing import Any

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
# Reasoning handed to a client to send back (Anthropic's thinking signature, Responses'
# encrypted_content): its text, so a client shown none of it can return it and the template
# gets it again. Not a secret: the client could ask for the text itself.
SIGNATURE_PREFIX = "mas1:"
CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
# The head of a call's body, up to where its arguments start.
_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"arguments"\s*:\s*')


def _held(text: str, tag: str) -> int:
    """How many characters at the end of `text` could be the start of `tag`: held back until
    the next piece says whether the tag comes."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


class ChatOutput:
    """feed(text) -> the deltas it completes; finish() -> the last ones. A delta is a dict of
    the OpenAI chunk's delta fields: content, reasoning_content, or tool_calls (one entry)."""

    def __init__(self, reasoning: bool, tools: bool, thinking: bool = False):
        """reasoning: split out <think> blocks; tools: parse <tool_call> blocks; thinking: the
        prompt opened a <think> block already (the reply starts inside it)."""
        self.reasoning, self.tools = reasoning, tools
        self.state = "reasoning" if thinking else ("start" if reasoning else "content")
        self.buf = ""  # text fed and not yet given out
        self.calls: list[dict[str, Any]] = []  # {"id", "name", "arguments"}
        self.body = ""  # the open call's text so far
        self.sent = 0  # of the open call's arguments, how many characters were given out
        self.args_at = -1  # where the open call's arguments start in body; -1: head not seen
        self.after_think = False  # the content right after </think>: its leading blank dropped
        self.blank = ""  # trailing whitespace of the content, held until more comes
        self.texted = False  # real content since the reply began or the last call

    def feed(self, text: str) -> list[dict[str, Any]]:
        self.buf += text
        out: list[dict[str, Any]] = []
        while self.buf and self._step(out, final=False):
            pass
        return out

    def finish(self) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        while self.buf and self._step(out, final=True):
            pass
        if self.state == "call":
            self._close_call(out, closed=False)
        self._flush_blank(out)
        return out

    def _flush_blank(self, out: list) -> None:
        """The held whitespace goes out after real content, and is dropped between calls."""
        if self.blank and self.texted:
            out.append({"content": self.blank})
        self.blank, self.texted = "", False

    # -- the states -------------------------------------------------------------------------

    def _step(self, out: list, final: bool) -> bool:
        """Consume what the buffer allows; True if the state changed and may consume more."""
        if self.state == "start":
            stripped = self.buf.lstrip()
            if stripped.startswith(THINK_OPEN):
                self.buf = stripped[len(THINK_OPEN):]
                self.state = "reasoning"
                return True
            if not final and THINK_OPEN.startswith(stripped):
                return False  # maybe the start of <think>
            self.state = "content"
            return True
        if self.state == "reasoning":
            return self._until(THINK_CLOSE, "reasoning_content", out, final, "content")
        if self.state == "content":
            if not self.tools:
                self._content(self.buf, out)
                self.buf = ""
                return False
            return self._until(CALL_OPEN, "content", out, final, "call")
        return self._call(out, final)

    def _until(self, tag: str, field: str, out: list, final: bool, then: str) -> bool:
        at = self.buf.find(tag)
        if at < 0:
            keep = 0 if final else _held(self.buf, tag)
            self._give(field, self.buf[:len(self.buf) - keep], out)
            self.buf = self.buf[len(self.buf) - keep:]
            return False
        self._give(field, self.buf[:at], out)
        self.buf = self.buf[at + len(tag):]
        if tag == THINK_CLOSE:
            self.after_think = True
        if then == "call":
            self.body, self.sent, self.args_at = "", 0, -1
            self._flush_blank(out)
        self.state = then
        return True

    def _give(self, field: str, text: str, out: list) -> None:
        if field == "content":
            self._content(text, out)
        elif text:
            out.append({field: text})

    def _content(self, text: str, out: list) -> None:
        """Content, without the blank line after </think> and without whitespace that only
        separates tool calls: trailing whitespace is held until real content follows, or a
        call opens or the reply ends after real content (then it goes out too). Held whatever
        the pieces, so a streamed reply's content is the whole reply's."""
        if self.after_think:
            text = text.lstrip()
            if not text:
                return
            self.after_think = False
        body = text.rstrip()
        if not body:
            self.blank += text
            return
        out.append({"content": self.blank + body})
        self.blank = text[len(body):]
        self.texted = True

    def _call(self, out: list, final: bool) -> bool:
        at = self.buf.find(CALL_CLOSE)
        if at < 0:
            keep = 0 if final else _held(self.buf, CALL_CLOSE)
            self.body += self.buf[:len(self.buf) - keep]
            self.buf = self.buf[len(self.buf) - keep:]
            self._advance(out)
            return False
        self.body += self.buf[:at]
        self.buf = self.buf[at + len(CALL_CLOSE):]
        self._close_call(out, closed=True)
        self.state = "content"
        return True

    def _advance(self, out: list) -> None:
        """The open call's head once its name is known, then its arguments up to the last
        character that cannot be the body's closing brace."""
        if self.args_at < 0:
            head = _HEAD.match(self.body)
            # Only once the arguments began: the whitespace before them is not theirs.
            if head is None or head.end() == len(self.body):
                return
            self.args_at = head.end()
            name = json.loads(head.group(1))
            call = {"id": "call_" + uuid.uuid4().hex[:24], "name": name, "arguments": ""}
            self.calls.append(call)
            out.append({"tool_calls": [{"index": len(self.calls) - 1, "id": call["id"],
                                        "type": "function",
                                        "function": {"name": name, "arguments": ""}}]})
        args = self.body[self.args_at:].rstrip()
        self._send_args(args[:-1], out)  # the last one may be the body's own "}"

    def _close_call(self, out: list, closed: bool) -> None:
        self._advance(out)
        if self.args_at < 0:  # no call head: the block was text, and stays text
            tail = CALL_CLOSE if closed else ""
            self._content(CALL_OPEN + self.body + tail, out)
            return
        args = self.body[self.args_at:].rstrip()
        if closed and args.endswith("}"):
            args = args[:-1]
        self._send_args(args, out)

    def _send_args(self, args: str, out: list) -> None:
        if len(args) <= self.sent:
            return
        call = self.calls[-1]
        piece = args[self.sent:]
        call["arguments"] += piece
        self.sent = len(args)
        out.append({"tool_calls": [{"index": len(self.calls) - 1,
                                    "function": {"arguments": piece}}]})


def finish_reason(reason: str, called: bool) -> str:
    """A reply that made tool calls and stopped by itself ends for them (OpenAI's reason)."""
    return "tool_calls" if called and reason == "stop" else reason


def whole_message(text: str, reasoning: bool, tools: bool,
                  thinking: bool = False) -> tuple[dict[str, Any], bool]:
    """A non-streamed reply's message fields, and whether it made tool calls."""
    parser = ChatOutput(reasoning, tools, thinking)
    deltas = parser.feed(text) + parser.finish()
    content = "".join(d.get("content", "") for d in deltas)
    thought = "".join(d.get("reasoning_content", "") for d in deltas)
    message: dict[str, Any] = {"role": "assistant", "content": content or None}
    if thought:
        message["reasoning_content"] = thought
    if parser.calls:
        message["tool_calls"] = [{"id": c["id"], "type": "function",
                                  "function": {"name": c["name"], "arguments": c["arguments"]}}
                                 for c in parser.calls]
    elif not content:
        message["content"] = ""
    return message, bool(parser.calls)


def sign(thinking: str) -> str:
    return SIGNATURE_PREFIX + base64.b64encode(thinking.encode()).decode()


def unsign(signature: str) -> str:
    """The reasoning text a signature of ours carries; "" for any other signature."""
    if not signature.startswith(SIGNATURE_PREFIX):
        return ""
    try:
        return base64.b64decode(signature[len(SIGNATURE_PREFIX):], validate=True).decode()
    except ValueError:
        return ""
