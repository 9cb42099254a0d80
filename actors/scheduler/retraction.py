"""Retraction (docs/architecture.md, section 8): when the running requests' next tokens do not
fit in KV memory, the least advanced one gives its memory back and returns to the head of the
queue. It is recomputed later from prompt + output so far, so its greedy tokens do not change.

A request with steps in flight is only marked (`Request.retracting`): its row and pages may
still be written, so it is requeued when its last step returns (future_map.py).
"""

from __future__ import annotations

from typing import Iterable

from actors.scheduler.request import Phase, Request


def pick_victim(running: Iterable[Request]) -> Request:
    """The active request with the fewest output tokens (the least recompute lost), the newest
    on a tie."""
    return min((r for r in running if r.active), key=lambda r: (len(r.output), -r.order))


def would_help(victim: Request, requests: Iterable[Request]) -> bool:
    """Retracting frees memory for someone only if another request holds some. Alone and still
    out of memory, the server's KV capacity (less the tree's pages its cached prefix keeps
    locked, memory.py) is the victim's length limit."""
    return any(r is not victim and (r.held or r.lock is not None) for r in requests)


def recompute_later(req: Request) -> None:
    """Reset a request whose memory was given back, for its next admission: it prefills its
    prompt and the output so far, and samples on from there."""
    req.phase, req.retracting = Phase.QUEUED, False
    req.fill = req.prompt + req.output
    req.filled = req.kv_len = 0
    req.sampled = len(req.output)
    req.retractions += 1
    if not req.output:
        req.scores = []  # retracted before its first token: the prompt is scored again
