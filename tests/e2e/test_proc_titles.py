"""Every process of the graph has a name ps can show: mas-launch and one per actor."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from actors.titles import set_title

ACTORS = {"mas-tokenizer", "mas-scheduler", "mas-runner", "mas-detokenizer"}


def _children(pid: int) -> list[int]:
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # gone while we looked
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found


def _title(pid: int) -> str:
    """setproctitle rewrites argv, so the title is the first word of the command line."""
    return Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode()


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/cmdline").exists(), reason="needs Linux /proc")
def test_launcher_and_actors_carry_their_names(graph):
    launcher = graph.proc.pid
    assert _title(launcher) == "mas-launch"
    titles = {pid: _title(pid) for pid in _children(launcher)}
    assert ACTORS <= set(titles.values()), titles
    by_actor = {f"mas-{name}": pid for name, pid in graph.actor_pids().items()}
    assert all(titles[pid] == title for title, pid in by_actor.items()), (titles, by_actor)


def test_a_missing_setproctitle_changes_nothing(monkeypatch):
    monkeypatch.setitem(sys.modules, "setproctitle", None)  # import fails as if not installed
    before = Path("/proc/self/cmdline").read_bytes() if Path("/proc/self").exists() else b""
    set_title("mas-test")
    assert (Path("/proc/self/cmdline").read_bytes() if before else b"") == before
