"""Responses API input items, as clients send them back: the test modules' shared builders."""

from __future__ import annotations

from typing import Any


def user(text: str) -> dict[str, Any]:
    return {"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}


def said(text: str) -> dict[str, Any]:
    return {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
            "content": [{"type": "output_text", "text": text, "annotations": []}]}


def thought(text: str) -> dict[str, Any]:
    return {"type": "reasoning", "id": "rs_1", "summary": [],
            "content": [{"type": "reasoning_text", "text": text}]}


def call(call_id: str, name: str, args: str = "{}", **extra: Any) -> dict[str, Any]:
    return {"type": "function_call", "call_id": call_id, "name": name, "arguments": args,
            **extra}


def output(call_id: str, text: str) -> dict[str, Any]:
    return {"type": "function_call_output", "call_id": call_id, "output": text}
