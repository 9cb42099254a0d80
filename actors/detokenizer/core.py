"""Incremental detokenization: token ids in, text that is safe to stream out.

Each request keeps a small window of recent ids. A feed decodes the window and
emits whatever text is new since the last emission. Two hazards shape it:

* Byte-level BPE and sentencepiece byte fallback split one character (CJK,
  emoji) over several tokens; until the last piece arrives the decoded tail is
  U+FFFD. That tail is held back, never emitted.
* Sentencepiece-style decoders drop the leading space of the first token they
  see, so the window always starts with one already-emitted token as context.

The window restarts after every clean emission, so the cost of a call depends
on the tokens in that call, not on the length of the output.
"""

from collections.abc import Callable, Iterable
from dataclasses import dataclass

REPLACEMENT = "\ufffd"
# A split UTF-8 character completes within 3 more tokens. A tail still ending in
# U+FFFD after this many feeds is a U+FFFD the model really produced: emit it
# rather than hold it (and grow the window) forever.
MAX_HELD_FEEDS = 8
# Enough prompt context for the first token's spacing; more only costs decode time.
PROMPT_CONTEXT = 4


@dataclass(slots=True)
class _Stream:
    ids: list[int]  # the window: context ids, then ids not yet emitted in full
    context: int  # ids[:context] were emitted by an earlier window
    sent: int  # characters of decode(ids) already emitted
    held: int = 0  # feeds in a row whose decoded tail was an unfinished character


class Detokenizer:
    """Per-request incremental detokenizer over any `decode(ids) -> str`.

    `decode` must turn an unfinished UTF-8 tail into U+FFFD (byte-level BPE and
    byte fallback both do) and must not change text before such a tail when
    more ids arrive.
    """

    def __init__(self, decode: Callable[[list[int]], str], skip_ids: Iterable[int] = ()):
        self._decode = decode
        self._skip = frozenset(skip_ids)  # e.g. EOS, so it never reaches the client as text
        self._streams: dict[str, _Stream] = {}

    def __len__(self) -> int:
        return len(self._streams)

    def __contains__(self, rid: str) -> bool:
        return rid in self._streams

    def start(self, rid: str, prompt_tail: list[int] | None = None) -> None:
        """Open a request; `prompt_tail` (last prompt ids) is context, never emitted."""
        if rid in self._streams:
            raise KeyError(f"request {rid!r} already started")
        ids = self._kept(prompt_tail or [])[-PROMPT_CONTEXT:]
        self._streams[rid] = _Stream(ids, len(ids), len(self._decode(ids)) if ids else 0)

    def feed(self, rid: str, new_ids: list[int]) -> str:
        """Take the request's newly generated ids; return only text safe to emit."""
        s = self._streams[rid]
        new_ids = self._kept(new_ids)
        if not new_ids:
            return ""
        s.ids.extend(new_ids)
        text = self._decode(s.ids)
        # Stop-string trimming goes here, between the decoded `text` and what is
        # released: it will hold back a possible stop prefix the way the
        # unfinished-character tail is held back below.
        if text.endswith(REPLACEMENT) and s.held < MAX_HELD_FEEDS:
            s.held += 1
            # Release what precedes the tail now; the window keeps growing until
            # the character completes, since the tail has no id boundary to cut at.
            safe = len(text.rstrip(REPLACEMENT))
            piece = text[s.sent : safe]
            s.sent = max(s.sent, safe)
            return piece
        piece = text[s.sent :]
        # Everything is out: the ids just emitted become the next window's context.
        s.ids = s.ids[s.context :]
        s.context = len(s.ids)
        s.sent = len(self._decode(s.ids))
        s.held = 0
        return piece

    def finish(self, rid: str) -> str:
        """Flush the rest (an unfinished tail comes out as U+FFFD) and free the request."""
        s = self._streams.pop(rid)
        return self._decode(s.ids)[s.sent :] if len(s.ids) > s.context else ""

    def drop(self, rid: str) -> None:
        """Free the request without output (abort); unknown rids are ignored."""
        self._streams.pop(rid, None)

    def _kept(self, ids: list[int]) -> list[int]:
        return [i for i in ids if i not in self._skip] if self._skip else list(ids)
