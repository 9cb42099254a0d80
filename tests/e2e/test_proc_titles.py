"""Every process of the graph has a name ps can show: mas-launch and one per actor."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from actors.titles import set_title
from harness.procs import children, title

ACTORS = {"mas-tokenizer", "mas-scheduler", "mas-runner", "mas-detokenizer"}


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/cmdline").exists(), reason="needs Linux /proc")
def test_launcher_and_actors_carry_their_names(graph):
    launcher = graph.proc.pid
    assert title(launcher) == "mas-launch"
    titles = {pid: title(pid) for pid in children(launcher)}
    assert ACTORS <= set(titles.values()), titles
    by_actor = {f"mas-{name}": pid for name, pid in graph.actor_pids().items()}
    assert all(titles[pid] == name for name, pid in by_actor.items()), (titles, by_actor)


def test_a_missing_setproctitle_changes_nothing(monkeypatch):
    monkeypatch.setitem(sys.modules, "setproctitle", None)  # import fails as if not installed
    before = Path("/proc/self/cmdline").read_bytes() if Path("/proc/self").exists() else b""
    set_title("mas-test")
    assert (Path("/proc/self/cmdline").read_bytes() if before else b"") == before
