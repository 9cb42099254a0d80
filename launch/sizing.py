"""`scheduler.max_running_requests = "auto"`: how many requests decode at once, sized by the
launcher before any actor starts, so every actor gets the same number in its config.

    auto = min(KV pool tokens // scheduler.auto_context_tokens, the throughput cap)

The throughput cap is the smallest decode batch that reaches 97% of the best tokens per second
measured on this machine (actors/model_runner/calibrate.py, run in a process of its own: the
launcher never imports MLX). The measurement is cached per model files, CPU, BLAS and runtime
config, so only a model's first launch on a machine pays for it (~2-10 s). On qwen3-small
(2-core x86, MKL) the rates were 580 / 770 / 1,060 / 1,290 / 1,450 tok/s at 8 / 16 / 32 / 64 /
128 rows: a fixed 16 left three quarters of 64 clients queued while the batch-64 step had room.
A hybrid model's state slots (one live per running request, the rest prefix snapshots) are
set to the running requests plus 64 snapshots unless memory.state_slots says otherwise, where
four per request would grow with the batch.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import msgspec

from models.info import ModelInfo
from models.sizing import kv_budget
from protocol.config import Config, config_to_dict

VERSION = 2  # bump when the calibration or what it runs on changes: cached answers are then
# remeasured (2: MKL's threads sleep between products, KMP_BLOCKTIME; a user's value is in the key)
SHARE = 0.97  # the cap reaches this share of the best measured rate: where it saturates
FALLBACK = 32  # when the calibration cannot run: the batch mlx_lm.server decodes by default
SNAPSHOT_SLOTS = 64
CALIBRATION_TIMEOUT_S = 300


class Sizing(msgspec.Struct, frozen=True):
    value: int
    why: str  # one line, for the ready line
    rates: dict[int, float] = {}  # the calibration's decode tok/s by rows, where measured


def calibration_dir() -> Path:
    """Beside the built-in models' cache (MAS_CACHE_DIR is the models folder there)."""
    models = os.environ.get("MAS_CACHE_DIR")
    root = Path(models).parent if models else Path.home() / ".cache" / "mlx-actor-serve"
    return root / "calibration"


def cpu_name() -> str:
    """The CPU's model name (the calibration's key; the benchmarks' machine line)."""
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f
                        if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def calibration_key(cfg: Config, model: ModelInfo) -> str:
    """What the measured rates depend on: the model's files (names, sizes, times), the machine
    and the runtime config (BLAS, weight kernels, greedy head) of one runner process."""
    folder = Path(model.path)
    files = sorted((p.name, p.stat().st_size, int(p.stat().st_mtime))
                   for p in folder.iterdir() if p.suffix in (".json", ".safetensors"))
    blob = json.dumps({"v": VERSION, "files": files, "path": str(folder.resolve()),
                       "cpu": cpu_name(), "cores": os.cpu_count(), "runners": cfg.runners_here(),
                       "runtime": config_to_dict(cfg)["runtime"],
                       "blocktime": os.environ.get("KMP_BLOCKTIME")}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def measured_rates(cfg: Config, model: ModelInfo) -> dict[int, float]:
    """Decode tokens per second by batch size: from the cache, else measured now (and cached).
    Raises RuntimeError when the calibration process fails."""
    file = calibration_dir() / f"{calibration_key(cfg, model)}.json"
    if file.is_file():
        try:
            return _rates(json.loads(file.read_text()))
        except (OSError, ValueError, KeyError, AttributeError):
            pass  # a damaged file is measured again
    job = json.dumps({"config": config_to_dict(cfg), "path": model.path})
    try:
        done = subprocess.run([sys.executable, "-m", "actors.model_runner.calibrate"],
                              input=job, capture_output=True, text=True,
                              timeout=CALIBRATION_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"the calibration took over {CALIBRATION_TIMEOUT_S} s") from None
    if done.returncode != 0:
        tail = done.stderr.strip().splitlines()[-1:] or ["no output"]
        raise RuntimeError(f"the calibration failed: {tail[0][:300]}")
    got = json.loads(done.stdout.strip().splitlines()[-1])
    file.parent.mkdir(parents=True, exist_ok=True)
    tmp = file.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps({**got, "model": model.path, "cpu": cpu_name()}) + "\n")
    tmp.replace(file)  # whole or absent, for launches racing on one machine
    return _rates(got)


def _rates(answer: dict) -> dict[int, float]:
    """The calibration's answer (as it prints it, and the cache keeps it): tok/s by rows."""
    return {int(b): float(r) for b, r in answer["rates"].items()}


def throughput_cap(rates: dict[int, float]) -> int:
    best = max(rates.values())
    return min(b for b, r in rates.items() if r >= SHARE * best)


def size(cfg: Config, model: ModelInfo) -> tuple[Config, Sizing]:
    """The config with max_running_requests a number, and how it was chosen."""
    running = cfg.scheduler.max_running_requests
    if isinstance(running, int):
        return cfg, Sizing(running, "scheduler.max_running_requests")
    by_memory = max(1, kv_budget(cfg, model) // cfg.scheduler.auto_context_tokens)
    rates: dict[int, float] = {}
    if cfg.runner.tp > 1:
        # Ranks on other hosts size their own configs: a measured number could differ there.
        cap, why_cap = FALLBACK, f"tensor parallel: capped at {FALLBACK}"
    else:
        try:
            rates = measured_rates(cfg, model)
            cap = throughput_cap(rates)
            why_cap = f"decode throughput stops growing at {cap} rows"
        except (RuntimeError, OSError, ValueError) as e:
            cap, why_cap = FALLBACK, f"{e}; capped at {FALLBACK}"
    value = min(by_memory, cap)
    why = (f"auto: the KV pool holds {by_memory} requests of "
           f"{cfg.scheduler.auto_context_tokens} tokens; {why_cap}")
    scheduler = msgspec.structs.replace(cfg.scheduler, max_running_requests=value)
    memory = cfg.memory
    if model.state_layers and not memory.state_slots:
        memory = msgspec.structs.replace(memory, state_slots=value + SNAPSHOT_SLOTS)
    return (msgspec.structs.replace(cfg, scheduler=scheduler, memory=memory),
            Sizing(value, why, rates))
