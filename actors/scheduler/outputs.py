"""What the scheduler's core hands its shell after each input: new tokens, endings, stop strings
to announce and retractions, shipped to the detokenizer as one TokenBatch."""

from __future__ import annotations

from dataclasses import dataclass, field

from protocol import messages as m
from protocol.codec import pack_ids


@dataclass
class Outputs:
    """What the core produced since the last take(): new tokens per rid, terminal records, and
    the requests sent back to the queue for lack of memory (for the logs)."""

    tokens: dict[str, list[int]] = field(default_factory=dict)
    finished: list[m.Finish] = field(default_factory=list)
    retracted: list[str] = field(default_factory=list)
    # Per token in `tokens` when asked: (logprob, top ids, top logprobs).
    logprobs: dict[str, list[tuple[float, list[int], list[float]]]] = field(default_factory=dict)
    stops: dict[str, list[str]] = field(default_factory=dict)
    prompt_scores: dict[str, m.PromptScores] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return bool(self.tokens or self.finished)

    def to_batch(self, running: int = 0, queued: int = 0, replica: int = 0,
                 kv_pages: list[int] = ()) -> m.TokenBatch:
        """`kv_pages`: [total, used, cached, free] of the KV pool (empty: not reported)."""
        rids = list(self.tokens)
        flat = [t for rid in rids for t in self.tokens[rid]]
        lps: list[float] = []
        top_ids: list[list[int]] = []
        top_lps: list[list[float]] = []
        if self.logprobs:
            for rid in rids:
                got = self.logprobs.get(rid) or [(0.0, [], [])] * len(self.tokens[rid])
                for lp, ids, vals in got:
                    lps.append(lp)
                    top_ids.append(ids)
                    top_lps.append(vals)
        return m.TokenBatch(rids=rids, counts=[len(self.tokens[r]) for r in rids],
                            token_ids=pack_ids(flat), finished=self.finished, logprobs=lps,
                            top_ids=top_ids, top_logprobs=top_lps, stops=self.stops,
                            prompt_scores=self.prompt_scores,
                            running=running, queued=queued, replica=replica,
                            kv_pages=list(kv_pages))

    def merge(self, other: "Outputs") -> None:
        for rid, toks in other.tokens.items():
            self.tokens.setdefault(rid, []).extend(toks)
        for rid, lps in other.logprobs.items():
            self.logprobs.setdefault(rid, []).extend(lps)
        self.finished.extend(other.finished)
        self.retracted.extend(other.retracted)
        self.stops.update(other.stops)
        self.prompt_scores.update(other.prompt_scores)
