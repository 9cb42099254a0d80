"""Memory sizes the scheduler and the runner must agree on, derived from config and model."""

from __future__ import annotations

import os

from models.info import ModelInfo
from protocol.config import Config


def kv_capacity(cfg: Config, model: ModelInfo) -> int:
    """KV slots: configured, or a fraction of physical memory over one token's KV bytes (no
    more than every running request at the full context)."""
    budget, running = kv_budget(cfg, model), cfg.scheduler.max_running_requests
    if cfg.memory.kv_tokens:
        return budget
    ceiling = running * model.context_length if isinstance(running, int) else budget
    return max(1, min(budget, ceiling))


def kv_budget(cfg: Config, model: ModelInfo) -> int:
    """The KV tokens memory allows: memory.kv_tokens, or memory.kv_fraction of this machine's
    physical memory (shared by the runner processes on it) over one token's KV bytes."""
    if cfg.memory.kv_tokens:
        return cfg.memory.kv_tokens
    # The fraction holds the runner's workspace (its buffer cache) as well as the pool.
    room = max(0, _fraction_bytes(cfg) - workspace_bytes(cfg, model))
    return max(1, room // max(1, kv_bytes_per_token(cfg, model)))


def _fraction_bytes(cfg: Config) -> int:
    """memory.kv_fraction of this machine's physical memory, shared by the runner processes
    on it (the replicas' ranks)."""
    physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return int(physical // cfg.runners_here() * cfg.memory.kv_fraction)


MIB = 1 << 20
BUFFER_CACHE_MIB = (64, 1024)  # the bounds of runtime.buffer_cache_mib = auto


def buffer_cache_bytes(cfg: Config, model: ModelInfo) -> int:
    """MLX's buffer cache limit (runtime.buffer_cache_mib; CPU only, elsewhere MLX's own):
    the freed buffers the runner keeps for the next step. auto sizes it for a prefill
    chunk's largest arrays, two of one layer's attention scores (a chunk's queries over the
    longest context the KV budget holds, float32: the softmax's output beside its input),
    within 64-1024 MiB, and no more than a quarter of memory.kv_fraction where that sizes
    the pool."""
    set_mib = cfg.runtime.buffer_cache_mib
    if set_mib != "auto":
        return set_mib * MIB
    context = min(model.context_length, cfg.memory.kv_tokens or model.context_length)
    heads = model.attention_heads or 32  # unknown: as many as a large model has
    scores = 2 * cfg.scheduler.chunked_prefill_size * heads * context * 4
    low, high = BUFFER_CACHE_MIB
    bound = min(max(scores, low * MIB), high * MIB)
    if not cfg.memory.kv_tokens:  # the fraction holds the workspace too: half of it at most
        bound = min(bound, _fraction_bytes(cfg) // 4)
    return bound


def workspace_bytes(cfg: Config, model: ModelInfo) -> int:
    """What the runner holds beyond the weights and the KV pool: the buffer cache, and the
    live arrays of the step being built, the same largest arrays at most (one layer's
    scores and their softmax); memory.kv_fraction counts it beside the pool."""
    return 2 * buffer_cache_bytes(cfg, model)


def running_requests(cfg: Config) -> int:
    running = cfg.scheduler.max_running_requests
    if not isinstance(running, int):
        raise ValueError("scheduler.max_running_requests is still auto: the launcher sizes it "
                         "before the actors start (launch/sizing.py)")
    return running


def kv_bytes_per_token(cfg: Config, model: ModelInfo) -> int:
    """One token's KV bytes as one runner rank keeps them: float32 under runtime.activations =
    "float32", else the checkpoint's dtype; with tensor parallelism each rank holds 1/tp of
    the KV heads, so the same memory per rank holds tp times the tokens."""
    per_token = model.kv_bytes_per_token
    if cfg.runtime.activations == "float32":
        per_token = per_token // max(1, model.kv_value_bytes) * 4
    return per_token // cfg.runner.tp


def state_capacity(cfg: Config, model: ModelInfo) -> int:
    """Recurrent-state slots (hybrid models only): one live slot per running request, the
    rest hold prefix snapshots."""
    if not model.state_layers:
        return 0
    return cfg.memory.state_slots or 4 * running_requests(cfg)
