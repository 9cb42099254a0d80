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
    physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    physical //= cfg.runners_here()  # the replicas' ranks share this machine's memory
    return int(physical * cfg.memory.kv_fraction) // max(1, kv_bytes_per_token(cfg, model))


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
