"""Incremental detokenization: token ids in, text that is safe to stream out.

Each request keeps a small window of ids: those of its last emission (context),
then the ones not emitted yet. A feed decodes the window and emits the text past the
context. Two hazards shape it:

* Byte-level BPE and sentencepiece byte fallback split one character (CJK,
  emoji) over several tokens; until the last piece arrives the decoded tail is
  U+FFFD. Such a tail is held back, never emitted.
* Sentencepiece-style decoders drop the leading space of the first token they
  see, so the window starts with emitted ids whose text is already counted.

After each emission the emitted ids become the next window's context and older
ids are forgotten, so a call costs the same however long the output grows.
"""

from collections.abc import Callable, Iterable
from dataclasses import dataclass

REPLACEMENT = "\ufffd"
# A split character's unfinished tail is at most 3 bytes, so at most 3 ids: a
# clean place to cut lies within the last 3 ids when one exists at all.
MAX_TAIL_IDS = 3
# A tail still ending in U+FFFD after this many feeds is a U+FFFD the model
# really produced: emit it rather than hold it (and grow the window) forever.
MAX_HELD_FEEDS = 8
# Enough prompt context for the first token's spacing; more only costs decode time.
PROMPT_CONTEXT = 4


@dataclass(slots=True)
class _Stream:
    ids: list[int]  # the window: context ids, then ids not emitted yet
    context: int  # ids[:context] are emitted
    sent: int  # len(decode(ids[:context])): where new text starts in decode(ids)
    held: int = 0  # feeds in a row that emitted nothing because of an unfinished tail


class Detokenizer:
    """Per-request incremental detokenizer over any `decode(ids) -> str`.

    `decode` must turn an unfinished UTF-8 tail into U+FFFD (byte-level BPE and
    byte fallback both do) and, cut at a whole character, must give a prefix of
    what it gives for the longer list.
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
        """Open a request with `prompt_tail` (last prompt ids) as context, never emitted.

        Optional: `feed` opens an unknown request without context.
        """
        if rid in self._streams:
            raise KeyError(f"request {rid!r} already started")
        ids = self._kept(prompt_tail or [])[-PROMPT_CONTEXT:]
        self._streams[rid] = _Stream(ids, len(ids), len(self._decode(ids)) if ids else 0)

    def feed(self, rid: str, new_ids: list[int]) -> str:
        """Take the request's newly generated ids; return only text safe to emit.

        Feeding after `finish`/`drop` opens the request again: free it last.
        """
        if rid not in self._streams:
            self.start(rid)
        s = self._streams[rid]
        new_ids = self._kept(new_ids)
        if not new_ids:
            return ""
        s.ids.extend(new_ids)
        cut, text = len(s.ids), self._decode(s.ids)
        if text.endswith(REPLACEMENT) and s.held < MAX_HELD_FEEDS:
            found = self._last_clean_cut(s)
            if found is None:
                s.held += 1
                return ""
            cut, text = found
        piece = text[s.sent :]
        s.ids, s.context = s.ids[s.context :], cut - s.context
        s.sent = len(self._decode(s.ids[: s.context]))
        s.held = 0
        return piece

    def finish(self, rid: str) -> str:
        """Flush the rest (an unfinished tail comes out as U+FFFD) and free the request.

        A request never fed (aborted before its first token) flushes "".
        """
        s = self._streams.pop(rid, None)
        return self._decode(s.ids)[s.sent :] if s is not None and len(s.ids) > s.context else ""

    def drop(self, rid: str) -> None:
        """Free the request without output (abort); unknown rids are ignored."""
        self._streams.pop(rid, None)

    def _last_clean_cut(self, s: _Stream) -> tuple[int, str] | None:
        """The last cut past the context where the text ends on a whole character."""
        for cut in range(len(s.ids) - 1, max(s.context, len(s.ids) - 1 - MAX_TAIL_IDS), -1):
            text = self._decode(s.ids[:cut])
            if not text.endswith(REPLACEMENT):
                return cut, text
        return None

    def _kept(self, ids: list[int]) -> list[int]:
        return [i for i in ids if i not in self._skip] if self._skip else list(ids)
