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

from actors.model_runner.rows import StepError
from actors.model_runner.sampling import score
from protocol import messages as m


@dataclass
class PendingScores:
    """A chunk's prompt scores, not read back yet."""

    start: int  # the first position scored
    logprobs: mx.array
    top_ids: mx.array | None  # None: no alternatives asked
    top_logprobs: mx.array | None

    def arrays(self) -> list[mx.array]:
        return [a for a in (self.logprobs, self.top_ids, self.top_logprobs) if a is not None]

    def resolve(self) -> m.PromptScores:
        n = self.logprobs.shape[0]
        none = [[]] * n
        return m.PromptScores(
            start=self.start, logprobs=self.logprobs.tolist(),
            top_ids=none if self.top_ids is None else self.top_ids.tolist(),
            top_logprobs=none if self.top_logprobs is None else self.top_logprobs.tolist())


def score_chunk(logits: mx.array, ids: list[int], start: int, first: int, next_id: int,
                k: int) -> PendingScores:
    """logits [n, V] of the chunk `ids` at `start`: the scores of the prompt tokens at
    positions first .. the chunk's end (and the one after it when next_id is a token, not
    -1), with k alternatives each. The scheduler sends only chunks with something to score."""
    targets = ids[first - start:] + ([next_id] if next_id >= 0 else [])
    if not start < first <= start + len(ids) or not targets:
        raise StepError(f"prompt scores from position {first} for a chunk of {len(ids)} "
                        f"tokens at {start}")
    at = first - start - 1  # the logits before position `first`
    lp, top_ids, top_lps = score(logits[at:at + len(targets)], mx.array(targets), k)
    return PendingScores(first, lp, top_ids, top_lps)
