"""scheduler.max_running_requests = "auto" (launch/sizing.py): the KV pool's requests, capped
where the measured decode throughput saturates; a number in the config wins."""

from __future__ import annotations

import json

import pytest

from launch import sizing
from models.builtin import ensure_builtin
from models.info import read_model_info
from protocol.config import ConfigError, load_config


@pytest.fixture
def tiny(model_cache, tmp_path, monkeypatch):
    monkeypatch.setenv("MAS_CACHE_DIR", str(tmp_path / "models"))  # a calibration cache of its own
    path = ensure_builtin("qwen3-tiny", cache_dir=model_cache, progress=False)
    return read_model_info(str(path))


def _cfg(*overrides: str):
    return load_config(None, list(overrides))


def _cache(cfg, model, rates: dict[int, float]) -> None:
    file = sizing.calibration_dir() / f"{sizing.calibration_key(cfg, model)}.json"
    file.parent.mkdir(parents=True, exist_ok=True)
    file.write_text(json.dumps({"rates": {str(b): r for b, r in rates.items()}}))


def test_auto_is_the_default_and_a_bad_value_names_the_key():
    assert _cfg().scheduler.max_running_requests == "auto"
    with pytest.raises(ConfigError, match=r"max_running_requests"):
        _cfg("scheduler.max_running_requests=many")


def test_a_number_in_the_config_wins(tiny):
    cfg, got = sizing.size(_cfg("scheduler.max_running_requests=12"), tiny)
    assert cfg.scheduler.max_running_requests == got.value == 12
    assert got.why == "scheduler.max_running_requests"


def test_the_cap_is_where_throughput_saturates():
    assert sizing.throughput_cap({8: 400, 16: 700, 32: 950, 64: 1000, 128: 1010}) == 64
    assert sizing.throughput_cap({8: 400, 16: 800, 32: 1600}) == 32  # still growing: the top
    assert sizing.throughput_cap({8: 1000, 16: 990, 32: 1000}) == 8  # flat from the start


def test_auto_takes_the_smaller_of_memory_and_throughput(tiny):
    cfg = _cfg("memory.kv_tokens=1000000")
    _cache(cfg, tiny, {8: 100.0, 16: 190.0, 32: 200.0, 64: 201.0})
    sized, got = sizing.size(cfg, tiny)
    assert got.value == sized.scheduler.max_running_requests == 32  # 1e6 // 2048 = 488
    assert "488 requests of 2048 tokens" in got.why and "at 32 rows" in got.why
    cfg = _cfg("memory.kv_tokens=40000", "scheduler.auto_context_tokens=4000")
    _cache(cfg, tiny, {8: 100.0, 16: 190.0, 32: 200.0, 64: 201.0})
    assert sizing.size(cfg, tiny)[1].value == 10  # memory first: 40,000 // 4,000


def test_a_first_launch_measures_the_model_and_later_ones_read_the_cache(tiny, monkeypatch):
    cfg = _cfg("memory.kv_tokens=1000000")
    rates = sizing.measured_rates(cfg, tiny)  # the real calibration process, on qwen3-tiny
    assert sorted(rates) == [8, 16, 32, 64, 128, 256] and all(r > 0 for r in rates.values())
    monkeypatch.setattr(sizing.subprocess, "run", None)  # a second measurement would fail
    assert sizing.measured_rates(cfg, tiny) == rates
    # The key covers the runtime config: another greedy-head setting is measured afresh.
    other = _cfg("memory.kv_tokens=1000000", "runtime.greedy_head=false")
    assert sizing.calibration_key(other, tiny) != sizing.calibration_key(cfg, tiny)


def test_a_failed_calibration_falls_back_and_says_why(tiny, monkeypatch):
    class Failed:
        returncode, stdout, stderr = 1, "", "Traceback ...\nValueError: no model here"

    monkeypatch.setattr(sizing.subprocess, "run", lambda *a, **k: Failed())
    _, got = sizing.size(_cfg("memory.kv_tokens=1000000"), tiny)
    assert got.value == sizing.FALLBACK
    assert "the calibration failed: ValueError: no model here" in got.why


def test_hybrid_models_get_state_slots_for_the_running_requests_and_snapshots(model_cache,
                                                                              tmp_path,
                                                                              monkeypatch):
    monkeypatch.setenv("MAS_CACHE_DIR", str(tmp_path / "models"))
    model = read_model_info(str(ensure_builtin("qwen3_5-tiny", cache_dir=model_cache,
                                               progress=False)))
    cfg = _cfg("memory.kv_tokens=100000")
    _cache(cfg, model, {8: 100.0, 16: 200.0})
    sized, got = sizing.size(cfg, model)
    assert got.value == 16 and sized.memory.state_slots == 16 + sizing.SNAPSHOT_SLOTS
    sized, _ = sizing.size(_cfg("memory.kv_tokens=100000", "memory.state_slots=50"), model)
    assert sized.memory.state_slots == 50  # the config's own number stays


def test_the_workspace_bound_is_two_layers_scores_of_a_chunk_within_its_bounds(tiny):
    """runtime.buffer_cache_mib = auto: a prefill chunk's queries over the longest context
    the budget holds, twice, float32, in 64-1024 MiB; the workspace is the cache and a step's
    live arrays, and kv_fraction holds it beside the pool (half of it at most)."""
    from models.sizing import MIB, buffer_cache_bytes, kv_budget, kv_bytes_per_token
    from models.sizing import workspace_bytes

    assert _cfg().runtime.buffer_cache_mib == "auto"
    heads = tiny.attention_heads
    assert heads > 0
    cfg = _cfg("memory.kv_tokens=100000", "scheduler.chunked_prefill_size=64")
    context = min(tiny.context_length, 100000)
    assert buffer_cache_bytes(cfg, tiny) == min(max(2 * 64 * heads * context * 4, 64 * MIB),
                                                1024 * MIB)
    assert workspace_bytes(cfg, tiny) == 2 * buffer_cache_bytes(cfg, tiny)
    assert buffer_cache_bytes(_cfg("memory.kv_tokens=16"), tiny) == 64 * MIB  # the floor
    assert buffer_cache_bytes(_cfg("runtime.buffer_cache_mib=300"), tiny) == 300 * MIB
    assert workspace_bytes(_cfg("runtime.buffer_cache_mib=0"), tiny) == 0
    for fraction in (0.5, 0.001):
        auto = _cfg(f"memory.kv_fraction={fraction}")
        none = _cfg(f"memory.kv_fraction={fraction}", "runtime.buffer_cache_mib=0")
        per_token, held = kv_bytes_per_token(auto, tiny), workspace_bytes(auto, tiny)
        assert 0 < held <= kv_budget(none, tiny) * per_token // 2 + per_token
        assert kv_budget(none, tiny) - kv_budget(auto, tiny) in range(
            held // per_token - 1, held // per_token + 2)
    assert buffer_cache_bytes(_cfg("memory.kv_fraction=0.5"), tiny) == min(
        2 * 512 * heads * tiny.context_length * 4, 1024 * MIB)
