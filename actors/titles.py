"""Process titles: `ps` and `top` show mas-launch, mas-tokenizer, mas-scheduler, mas-runner and
mas-detokenizer instead of five identical python command lines."""

from __future__ import annotations

from pathlib import Path


def set_title(name: str) -> None:
    """This process's title (its argv as /proc/PID/cmdline and ps show it). Without the
    setproctitle package the title stays as it was, silently: it is a convenience."""
    try:
        from setproctitle import setproctitle
    except ImportError:
        return
    setproctitle(name)


def title(pid: int) -> str:
    """A process's title: setproctitle rewrites argv, so the first word of its command line
    ("" once it is gone)."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode()
    except OSError:
        return ""


def children(pid: int) -> list[int]:
    """The processes whose parent is `pid` (Linux /proc)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # gone while we looked
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found
