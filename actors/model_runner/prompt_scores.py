"""Prompt logprobs (GenerateRequest.logprob_start_len, OpenAI's `echo` with `logprobs`): the
logprob of each prompt token given the tokens before it, from the logits of a prompt chunk
the runner computes anyway, with the sampler's own scoring code (sampling.score).

A chunk of positions [start, start + n) has logits at each position for the token after it:
position p's logits score the prompt token at p + 1, the chunk's last position the first token
of the next chunk (the scheduler sends it, ForwardBatch.score_next) or, in the prompt's last
chunk, the sampled token (scored as generated tokens are). Rows that ask for none take the
usual path, with the LM head on the last position only."""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from actors.model_runner.sampling import score
from protocol import messages as m


@dataclass
class PendingScores:
    """A chunk's prompt scores, not read back yet."""

    start: int  # the first position scored
    logprobs: mx.array | None
    top_ids: mx.array | None
    top_logprobs: mx.array | None

    def arrays(self) -> list[mx.array]:
        return [a for a in (self.logprobs, self.top_ids, self.top_logprobs) if a is not None]

    def resolve(self) -> m.PromptScores:
        if self.logprobs is None:
            return m.PromptScores(start=self.start)
        top_ids = self.top_ids.tolist() if self.top_ids is not None else None
        top_lps = self.top_logprobs.tolist() if self.top_logprobs is not None else None
        n = self.logprobs.shape[0]
        return m.PromptScores(start=self.start, logprobs=self.logprobs.tolist(),
                              top_ids=top_ids or [[]] * n, top_logprobs=top_lps or [[]] * n)


def score_chunk(logits: mx.array, ids: list[int], start: int, first: int, next_id: int,
                k: int) -> PendingScores:
    """logits [n, V] of the chunk `ids` at `start`: the scores of the prompt tokens at
    positions max(first, start + 1) .. the chunk's end (and the one after it when next_id is
    a token, not -1), with k alternatives each."""
    first = max(first, start + 1)
    targets = ids[first - start:] + ([next_id] if next_id >= 0 else [])
    if not targets:
        return PendingScores(first, None, None, None)
    at = first - start - 1  # the logits before position `first`
    lp, top_ids, top_lps = score(logits[at:at + len(targets)], mx.array(targets), k)
    return PendingScores(first, lp, top_ids, top_lps)
