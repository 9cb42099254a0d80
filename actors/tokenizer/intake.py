"""The one boundary where untrusted bytes become typed requests, for both APIs.

A ZMQ frame or an HTTP body is decoded against the wire schema (protocol/messages.py, whose
numeric bounds make every accepted number fit the graph's wire), then checked against the
configured limits (`[limits]`: bytes, nesting depth, string and list lengths). Whatever goes
wrong, the caller gets a `RequestError` naming the problem, never another exception: invalid
UTF-8, nesting deeper than the decoder can recurse, ints past 64 bits and NaNs all end here.
"""

from __future__ import annotations

from typing import Any, Iterable

import msgspec

from protocol import messages as m
from protocol.config import LimitsConfig


class RequestError(Exception):
    """A request refused for its content: `code` follows HTTP, `param` names the field."""

    def __init__(self, message: str, code: int = 400, param: str | None = None,
                 logged: bool = False):
        super().__init__(message)
        self.message, self.code, self.param = message, code, param
        self.logged = logged  # the frontend logged it already (it refused the request)


_client_decoder = msgspec.msgpack.Decoder(m.ClientInbound)


def describe(exc: BaseException, limits: LimitsConfig) -> str:
    """A decoder's exception as the client should read it: what is wrong, not a traceback."""
    match exc:
        case msgspec.ValidationError():
            return f"invalid request: {exc}"
        case msgspec.DecodeError():
            return f"malformed request: {exc}"
        case UnicodeError():
            return f"invalid request: a string is not valid UTF-8 ({exc.reason} at byte " \
                   f"{getattr(exc, 'start', '?')})"
        case RecursionError():
            return f"invalid request: nested deeper than limits.max_depth ({limits.max_depth})"
        case OverflowError():
            return "invalid request: a number does not fit in 64 bits"
    return f"invalid request: {type(exc).__name__}: {exc}"


def decode_frame(payload: bytes, limits: LimitsConfig) -> m.GenerateRequest | m.AbortRequest:
    """One ZMQ client frame -> a typed message (the limits of a GenerateRequest are checked
    by Frontend.submit, where both APIs meet)."""
    if len(payload) > limits.max_frame_bytes:
        raise RequestError(f"frame of {len(payload)} bytes is over limits.max_frame_bytes "
                           f"({limits.max_frame_bytes})")
    try:
        msg = _client_decoder.decode(payload)
    except Exception as e:  # every decoder failure is the frame's problem
        raise RequestError(describe(e, limits)) from None
    if isinstance(msg, m.AbortRequest):  # a GenerateRequest is checked where both APIs meet
        _check_strings([("req_id", msg.req_id)], limits)
    return msg


def decode_body(raw: bytes, cls: type, limits: LimitsConfig) -> Any:
    """One HTTP JSON body -> an instance of `cls` (a msgspec Struct)."""
    if len(raw) > limits.max_body_bytes:
        raise RequestError(f"body of {len(raw)} bytes is over limits.max_body_bytes "
                           f"({limits.max_body_bytes})", 413)
    try:
        # JSON is UTF-8 throughout; the decoder checks only the strings it keeps, so a bad
        # byte in a field it skips (an unknown key) would pass unseen.
        raw.decode("utf-8")
        return msgspec.json.decode(raw, type=cls)
    except msgspec.ValidationError as e:
        path = str(e).rsplit("$.", 1)
        param = path[1].split("[")[0].split(".")[0].rstrip("`") if len(path) > 1 else None
        raise RequestError(describe(e, limits), param=param) from None
    except Exception as e:
        raise RequestError(describe(e, limits)) from None


def check_request(req: m.GenerateRequest, limits: LimitsConfig) -> None:
    """The limits the schema cannot state: lengths of every string and list, and the depth of
    free-form values. Both APIs call it on the GenerateRequest they built."""
    _check_strings([("req_id", req.req_id), ("prompt", req.prompt), ("group", req.group),
                    ("json_schema", req.json_schema), ("regex", req.regex), ("ebnf", req.ebnf),
                    ("structural_tag", req.structural_tag), ("session", req.session),
                    *(("stop", s) for s in req.stop),
                    *(("messages", c.role) for c in req.messages),
                    *(("messages", c.content) for c in req.messages)], limits)
    for name, items in (("input_ids", req.input_ids), ("messages", req.messages),
                        ("stop_token_ids", req.stop_token_ids), ("logit_bias", req.logit_bias)):
        if len(items) > limits.max_list_items:
            raise RequestError(f"{name}: {len(items)} items is over limits.max_list_items "
                               f"({limits.max_list_items})", param=name)
    if len(req.stop) > limits.max_stop_strings:
        raise RequestError(f"stop: at most {limits.max_stop_strings} stop strings "
                           f"(limits.max_stop_strings), got {len(req.stop)}", param="stop")
    check_value("chat_template_kwargs", req.chat_template_kwargs, limits)
    check_value("tools", req.tools, limits)
    for msg in req.messages:
        check_value("messages", msg.tool_calls, limits)
        _check_strings([("messages", msg.tool_call_id), ("messages", msg.name),
                        ("messages", msg.reasoning_content)], limits)


def check_value(name: str, value: Any, limits: LimitsConfig, depth: int = 1) -> None:
    """A free-form value (decoded as Any): its nesting, strings and lists within the limits.
    Iterative, so a value nested as deep as the decoder allowed cannot overflow the stack."""
    stack = [(value, depth)]
    while stack:
        item, level = stack.pop()
        if isinstance(item, str):
            _check_strings([(name, item)], limits)
            continue
        if not isinstance(item, (list, dict)):
            continue
        if level > limits.max_depth:
            raise RequestError(f"{name}: nested deeper than limits.max_depth "
                               f"({limits.max_depth})", param=name)
        if len(item) > limits.max_list_items:
            raise RequestError(f"{name}: {len(item)} items is over limits.max_list_items "
                               f"({limits.max_list_items})", param=name)
        children = [*item.keys(), *item.values()] if isinstance(item, dict) else item
        stack.extend((child, level + 1) for child in children)


def _check_strings(named: Iterable[tuple[str, str]], limits: LimitsConfig) -> None:
    for name, text in named:
        if len(text) > limits.max_string_chars:
            raise RequestError(f"{name}: a string of {len(text)} characters is over "
                               f"limits.max_string_chars ({limits.max_string_chars})",
                               param=name)
