"""Stop strings in streamed text: hold back what could be the start of a stop string, so a
client never sees any part of one. Whether one matched is the scheduler's call alone (it knows
min_new_tokens and ends the request in the batch whose token completed it, with
Finish.stop_str); the text is cut there when the request ends."""

from __future__ import annotations


class StopTrimmer:
    def __init__(self, stops: list[str]):
        self.stops = stops
        self.pending = ""  # text held back: it may be the start of a stop string

    def push(self, text: str) -> str:
        self.pending += text
        hold = max((k for s in self.stops for k in range(1, len(s))
                    if self.pending.endswith(s[:k])), default=0)
        cut = len(self.pending) - hold
        out, self.pending = self.pending[:cut], self.pending[cut:]
        return out

    def end(self, emitted: str, tail: str, stop_str: str) -> str:
        """The request ended: `emitted` is what push gave for its last batch, `tail` the text
        after it. The final text, cut before `stop_str` when a stop string ended it (its start
        was held back, so it lies in this text)."""
        text = emitted + self.pending + tail
        self.pending = ""
        at = text.find(stop_str) if stop_str else -1
        return text[:at] if at >= 0 else text
