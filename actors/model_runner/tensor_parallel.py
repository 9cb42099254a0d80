"""Tensor parallelism (`runner.tp` > 1): the model-runner actor as tp ranks of one
mlx.distributed group, each holding 1/tp of every sharded layer.

Rank 0 ("runner", "runner.R" for data-parallel replica R) is the actor the scheduler talks
to. It hands every frame of its inbox, as received, to the other ranks ("runner-1", ...)
before it runs the batch itself, so all ranks apply the same ops, resolve the same futures
from their own token buffers and run the same forward; the collectives inside the sharded
layers (mlx-lm's `shard()`) give every rank the same hidden states, hence the same logits
and, with the same per-row seeds, the same tokens. Only rank 0 sends StepResults.

The hand-over is a ZMQ PUSH of the undecoded frame per rank (tens of microseconds): an
`mx.distributed` broadcast would cost two collectives per step (length, then bytes, 0.03-0.6
ms each over loopback) and park the ranks' MLX threads inside a collective while idle, where a
shutdown cannot reach them.
"""

from __future__ import annotations

import json
import os
import tempfile
import time

from protocol.config import Config
from protocol.transport import Addresses


def ring_hostfile(endpoints: list[str]) -> str:
    """A temporary file in the format mlx's ring backend reads (a JSON list of each rank's
    endpoints, "host:port"): its path, for MLX_HOSTFILE. The caller removes it."""
    fd, path = tempfile.mkstemp(prefix="mas-ring-", suffix=".json")
    with os.fdopen(fd, "w") as f:
        json.dump([[endpoint] for endpoint in endpoints], f)
    return path


def join(cfg: Config, addrs: Addresses, replica: int, rank: int):
    """This process's mlx.distributed group (None when tp = 1). Blocks until every rank has
    joined. Call it on the MLX thread, before the model is loaded."""
    import mlx.core as mx

    tp = cfg.runner.tp
    if tp == 1:
        return None
    os.environ["MLX_RANK"] = str(rank)
    if cfg.runner.backend == "ring":
        os.environ["MLX_HOSTFILE"] = ring_hostfile(addrs.ring[replica])
    try:
        group = mx.distributed.init(strict=True, backend=cfg.runner.backend)
    finally:
        if cfg.runner.backend == "ring":
            os.unlink(os.environ.pop("MLX_HOSTFILE"))
    if group.size() != tp or group.rank() != rank:
        raise RuntimeError(f"runner.tp = {tp}: mlx.distributed made rank {group.rank()} of "
                           f"{group.size()}, expected rank {rank} of {tp}")
    return group


def shard(model, group) -> None:
    """Keep this rank's share of the model (mlx-lm's own sharding). A model class without
    `shard()` cannot run tensor parallel: refuse it by name."""
    import mlx.core as mx

    if not callable(getattr(model, "shard", None)):
        cls = type(model)
        raise ValueError(f"runner.tp = {group.size()}: the model class "
                         f"{cls.__module__}.{cls.__qualname__} has no shard() (mlx-lm "
                         "shards qwen2, qwen3, qwen3_moe, qwen3_5, llama and others); "
                         "set runner.tp = 1")
    check_divisible(model, group.size())
    model.shard(group)
    mx.eval(model.parameters())


# Head counts mlx-lm's shard() splits evenly between the ranks.
_SPLIT = ("num_attention_heads", "num_key_value_heads", "intermediate_size")


def check_divisible(model, tp: int) -> None:
    """ValueError naming the first head count (or width) tp does not divide."""
    for owner in (model, getattr(model, "language_model", None)):
        args = getattr(owner, "args", None)
        if args is None:
            continue
        for key in _SPLIT:
            value = getattr(args, key, None)
            if isinstance(value, int) and value % tp:
                raise ValueError(f"runner.tp = {tp} does not divide the model's {key} "
                                 f"({value}): pick a tp that does")


class Watchdog:
    """Tells a stalled rank from a busy or idle one. The MLX thread beats after every launch
    and read-back and says when it waits for work; a rank whose peer died or hung blocks in a
    collective with neither happening."""

    def __init__(self, timeout_s: float):
        self.timeout_s = timeout_s
        self.beat_at = time.monotonic()
        self.idle = True

    def beat(self) -> None:
        self.beat_at = time.monotonic()

    def waiting(self, idle: bool) -> None:
        self.idle = idle
        self.beat_at = time.monotonic()

    def stalled_for(self, now: float | None = None) -> float:
        """Seconds this rank has been stuck past the timeout's start; 0 when it is not."""
        now = time.monotonic() if now is None else now
        late = now - self.beat_at
        return 0.0 if self.idle or late < self.timeout_s else late
