"""The ForwardBatch builder: owns the batch's columns, so the scheduler's schedule() decides
policy only (who decodes, how much of which prompt runs, who is admitted) and never handles the
parallel lists of the wire format (protocol.messages.ForwardBatch).
"""

from __future__ import annotations

from protocol import messages as m
from protocol.codec import pack_ids
from actors.scheduler.request import Request


class BatchBuilder:
    def __init__(self):
        # One entry per row of the step, in row order.
        self.rows: list[int] = []
        self.lens: list[int] = []
        self.starts: list[int] = []
        self.future: list[bool] = []
        self.sample: list[bool] = []
        self.carried: list[Request] = []
        self.ids: list[int] = []  # the non-future rows' inputs, concatenated
        # One entry per request admitted in this step.
        self.admitted: list[Request] = []
        self.admit_tokens: list[bytes] = []
        # One entry per scored prompt chunk (ForwardBatch.score_rows).
        self.score_rows: list[int] = []
        self.score_start: list[int] = []
        self.score_next: list[int] = []

    def __bool__(self) -> bool:
        return bool(self.rows)

    def _row(self, req: Request, n: int, start: int, future: bool, sample: bool) -> None:
        self.rows.append(req.row)
        self.lens.append(n)
        self.starts.append(start)
        self.future.append(future)
        self.sample.append(sample)
        self.carried.append(req)

    def decode(self, req: Request) -> None:
        """One token at the next position, its input a future; samples the next token."""
        self._row(req, 1, req.kv_len, True, True)

    def prefill(self, req: Request, tokens: list[int], start: int, sample: bool) -> None:
        """A prompt chunk at `start`; samples after it when it is the prompt's last."""
        self._row(req, len(tokens), start, False, sample)
        self.ids.extend(tokens)
        if req.scoring:
            # Its logits score the tokens at start + 1 .. the chunk's end, and the next
            # chunk's first token unless this one samples.
            first = max(req.params.prompt_logprobs_from, 1, start + 1)
            end = start + len(tokens) + (0 if sample else 1)
            if first < end:
                self.score_rows.append(req.row)
                self.score_start.append(first)
                self.score_next.append(-1 if sample else req.fill[start + len(tokens)])

    def admit(self, req: Request) -> None:
        """The row's sampling parameters (and, when its penalties need them, the tokens so far)
        travel once, with the step that first runs it."""
        self.admitted.append(req)
        self.admit_tokens.append(pack_ids(req.fill) if req.needs_history else b"")

    def build(self, step: int, ops: list[m.Op], released: list[int],
              states: bool, hold_decode: bool = False) -> m.ForwardBatch:
        """`states`: the model keeps recurrent state, so each admitted row names its slot.
        `hold_decode`: the decoding rows sit this step out (ForwardBatch.hold_decode)."""
        return m.ForwardBatch(
            step=step, rows=self.rows, input_lens=self.lens, start_pos=self.starts,
            future=self.future, sample=self.sample, input_ids=pack_ids(self.ids),
            admit_rows=[r.row for r in self.admitted],
            admit_params=[r.params for r in self.admitted],
            release_rows=released, ops=ops,
            admit_states=[r.state for r in self.admitted] if states else [],
            admit_generated=[len(r.output) for r in self.admitted],
            admit_tokens=self.admit_tokens, score_rows=self.score_rows,
            score_start=self.score_start, score_next=self.score_next, hold_decode=hold_decode)
