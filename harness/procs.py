"""The graph's processes as Linux's /proc shows them: a launcher's children and the titles
they carry (mas-launch, mas-tokenizer, ...), for the tests and benchmarks that look at them."""

from __future__ import annotations

from pathlib import Path


def children(pid: int) -> list[int]:
    """The processes whose parent is `pid`."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # gone while we looked
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found


def title(pid: int) -> str:
    """setproctitle rewrites argv, so the title is the first word of the command line."""
    return Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode()
