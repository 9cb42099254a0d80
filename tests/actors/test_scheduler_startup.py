"""The scheduler actor's startup: it waits for the runner's ModelLayers (keeping whatever came
first, in order) and builds its core with the prefix cache those layers allow."""

import asyncio
from collections import deque
from types import SimpleNamespace

import pytest
import structlog
from structlog.testing import capture_logs

from models.builtin import ensure_builtin
from models.info import read_model_info
from models.tokenizer import load_decoder
from actors.scheduler.actor import SchedulerActor
from protocol import messages as m
from protocol.config import config_from_dict


class ScriptedInbox:
    """Hands out the given bursts, then nothing until the timeout passes."""

    def __init__(self, bursts):
        self.bursts = deque(bursts)

    async def recv_all(self, timeout=None):
        if self.bursts:
            return self.bursts.popleft()
        await asyncio.sleep(timeout)
        return []


def make_actor(bursts=(), model=None, **config):
    actor = SchedulerActor.__new__(SchedulerActor)  # no sockets: the inbox is scripted
    # Actors get the launcher's config, auto already sized (launch/sizing.py).
    config.setdefault("scheduler", {}).setdefault("max_running_requests", 16)
    actor.shell = SimpleNamespace(cfg=config_from_dict(config), model=model)
    actor.log = structlog.get_logger()
    actor.inbox = ScriptedInbox(bursts)
    actor.decode = load_decoder(model.path) if model is not None else None
    return actor


async def test_messages_before_the_layers_are_kept_in_order():
    a, b, c = m.Abort(rid="a"), m.Abort(rid="b"), m.Abort(rid="c")
    actor = make_actor([[a], [b, m.ModelLayers(kinds=["full"]), c]])
    assert await actor._await_layers() == (m.ModelLayers(kinds=["full"]), [a, b, c])


async def test_a_shutdown_before_the_layers_ends_the_wait():
    actor = make_actor([[m.Abort(rid="a")], [m.Shutdown(reason="launch failed")]])
    assert await actor._await_layers() is None


async def test_no_layers_within_the_ready_timeout_fails_loudly():
    actor = make_actor(launch={"ready_timeout_s": 0.05})
    with pytest.raises(TimeoutError, match="no ModelLayers from the runner within 0.05 s"):
        await actor._await_layers()


@pytest.mark.parametrize("prefix", [True, False])
def test_sliding_layers_build_the_core_with_window_snapshots(model_cache, prefix):
    """A sliding-window model keeps the configured prefix cache: its state slots (sized from
    config.json's sliding layers) hold the windows' snapshots."""
    info = read_model_info(str(ensure_builtin("gemma3-tiny", model_cache, progress=False)))
    assert info.state_layers == 2
    actor = make_actor(model=info, cache={"prefix": prefix})
    with capture_logs() as logs:
        core = actor._build_core(m.ModelLayers(kinds=["sliding", "full", "sliding", "full"]))
    assert core.memory.prefix == prefix and core.memory.tree is not None
    assert core.memory.states is not None and core.memory.states.capacity > 0
    assert [r for r in logs if r["event"] == "cache.prefix_off"] == []


def test_a_layer_kind_no_slot_restores_builds_the_core_without_the_tree(model_cache):
    info = read_model_info(str(ensure_builtin("qwen3-tiny", model_cache, progress=False)))
    with capture_logs() as logs:
        core = make_actor(model=info)._build_core(m.ModelLayers(kinds=["full", "other:X"]))
    assert core.memory.tree is None and not core.memory.prefix
    [warning] = [r for r in logs if r["event"] == "cache.prefix_off"]
    assert warning["log_level"] == "warning" and warning["layers"] == {"other:X": [1]}
    assert "other:X layers keep nothing a radix node can restore" in warning["reason"]


def test_full_layers_keep_the_configured_prefix_cache(model_cache):
    info = read_model_info(str(ensure_builtin("qwen3-tiny", model_cache, progress=False)))
    with capture_logs() as logs:
        core = make_actor(model=info)._build_core(m.ModelLayers(kinds=["full", "full"]))
    assert core.memory.prefix and core.memory.tree is not None
    assert [r for r in logs if r["event"] == "cache.prefix_off"] == []
