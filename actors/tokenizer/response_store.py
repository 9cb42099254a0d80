"""The responses kept for previous_response_id and GET /v1/responses/{id}: in memory, least
recently used dropped past a count or a size (server.response_store_items / _mib). Each entry
holds the response object and the conversation it ends (the instructions apart: a later
request brings its own), so a request naming it continues the conversation."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import msgspec

from actors.tokenizer.openai_format import ChatMessageBody


@dataclass
class Stored:
    response: dict[str, Any]
    conversation: list[ChatMessageBody]
    size: int


class ResponseStore:
    def __init__(self, max_items: int, max_bytes: int):
        self.max_items, self.max_bytes = max_items, max_bytes
        self.entries: OrderedDict[str, Stored] = OrderedDict()
        self.bytes = 0

    def put(self, response: dict[str, Any], conversation: list[ChatMessageBody]) -> None:
        # The size as JSON: what the entry holds, within a small factor of its memory.
        size = len(msgspec.json.encode(response)) + len(msgspec.json.encode(conversation))
        if size > self.max_bytes or self.max_items == 0:
            return  # larger than the whole store: not kept
        self.delete(response["id"])
        self.entries[response["id"]] = Stored(response, conversation, size)
        self.bytes += size
        while len(self.entries) > self.max_items or self.bytes > self.max_bytes:
            _, dropped = self.entries.popitem(last=False)
            self.bytes -= dropped.size

    def get(self, response_id: str) -> Stored | None:
        entry = self.entries.get(response_id)
        if entry is not None:
            self.entries.move_to_end(response_id)
        return entry

    def delete(self, response_id: str) -> bool:
        entry = self.entries.pop(response_id, None)
        if entry is not None:
            self.bytes -= entry.size
        return entry is not None
