"""Stop strings in streamed text: hold back what could be the start of a stop string, and cut
the text where one matched, so a client never sees any part of it."""

from __future__ import annotations


class StopTrimmer:
    def __init__(self, stops: list[str]):
        self.stops = stops
        self.pending = ""  # text held back: it may be the start of a stop string
        self.done = False  # a stop string matched: nothing more is emitted

    def push(self, text: str) -> str:
        if self.done:
            return ""
        self.pending += text
        at = min((self.pending.find(s) for s in self.stops if s in self.pending), default=-1)
        if at >= 0:
            self.done = True
            out, self.pending = self.pending[:at], ""
            return out
        hold = max((k for s in self.stops for k in range(1, len(s))
                    if self.pending.endswith(s[:k])), default=0)
        cut = len(self.pending) - hold
        out, self.pending = self.pending[:cut], self.pending[cut:]
        return out

    def flush(self) -> str:
        """The request ended without a stop string: what was held back is ordinary text."""
        out, self.pending = ("" if self.done else self.pending), ""
        return out
