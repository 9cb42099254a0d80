"""A client pattern more than one e2e test needs."""

from __future__ import annotations

from typing import Any

from protocol.client import AsyncClient


async def abort_a_stream(client: AsyncClient, req_id: str = "victim", after: int = 3) -> Any:
    """Stream a long request, abort it once `after` text pieces came, return its final reply."""
    stream = await client.generate("Tell me a long story", max_new_tokens=2000,
                                   ignore_eos=True, stream=True, req_id=req_id)
    seen, final = 0, None
    async for piece in stream:
        if isinstance(piece, str):
            seen += 1
            if seen == after:
                await client.abort(req_id)
        else:
            final = piece
    return final
