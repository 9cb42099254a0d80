"""The correctness oracle: mlx-lm itself, on the same model directory and prompt ids."""

from __future__ import annotations

import mlx.core as mx
from mlx_lm import load, stream_generate

NEAR_TIE = 1e-4


class Oracle:
    def __init__(self, path: str, upcast: bool = False):
        """upcast: the checkpoint's floating parameters in float32 (scales of quantized ones
        too), the oracle of runtime.activations = "float32"."""
        self.model, self.tokenizer = load(path)
        if upcast:
            self.model.set_dtype(mx.float32)

    def greedy(self, prompt_ids: list[int], max_tokens: int) -> list[int]:
        """mlx_lm's greedy token ids, EOS included when it stops there."""
        return [r.token for r in stream_generate(self.model, self.tokenizer,
                                                  mx.array(prompt_ids), max_tokens=max_tokens)]

    def top2(self, ids: list[int]) -> tuple[list[int], float]:
        """The two best next tokens after `ids` and their logit gap."""
        logits = self.model(mx.array(ids)[None])[0, -1].astype(mx.float32)
        order = mx.argsort(-logits)[:2].tolist()
        return order, float(logits[order[0]] - logits[order[1]])

    def prompt_logprobs(self, ids: list[int]) -> tuple[list[float], list[int]]:
        """mlx-lm's own log_softmax over the prompt in one forward: each position's token's
        logprob given the tokens before it (from position 1), and the argmax before each."""
        logits = self.model(mx.array(ids)[None])[0].astype(mx.float32)
        lp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        chosen = mx.take_along_axis(lp[:-1], mx.array(ids[1:])[:, None], axis=-1)[:, 0]
        return chosen.tolist(), mx.argmax(lp[:-1], axis=-1).tolist()

    def check(self, prompt_ids: list[int], got: list[int], ref: list[int]) -> None:
        """got must equal ref; where they first differ, the reference must be at a near-tie
        (top-2 gap below 1e-4) and `got` must have taken the other of the two."""
        if got == ref:
            return
        i = next((k for k, (a, b) in enumerate(zip(got, ref)) if a != b), min(len(got), len(ref)))
        if i == len(got) or i == len(ref):
            raise AssertionError(f"length differs: got {len(got)} tokens, mlx-lm {len(ref)}\n"
                                 f"got {got}\nref {ref}")
        best, gap = self.top2(prompt_ids + ref[:i])
        assert gap < NEAR_TIE and set(best) == {got[i], ref[i]}, (
            f"token {i} differs: got {got[i]}, mlx-lm {ref[i]}, top-2 {best} gap {gap:.3g}")
