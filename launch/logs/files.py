"""Where a run's log file lives, and keeping the log folder bounded: the per-run file name, the
pruning of old runs, and size rotation. Only the launcher calls `prepare_run_file`, `prune_runs`
and `rotate` (one rotator: see actors/logs.py for why the writers stay safe)."""

from __future__ import annotations

import os
import re
import time
from pathlib import Path

from protocol.config import LogConfig

RUN_FILE = re.compile(r"^(\d{8}-\d{6}-\d+)\.jsonl(?:\.(\d+))?$")


def run_file_name(started: float, pid: int) -> str:
    """`20250601-142233-4711.jsonl`: the launcher's start (local time) and pid, so names sort
    by start time and two launchers started in one second do not collide."""
    return f"{time.strftime('%Y%m%d-%H%M%S', time.localtime(started))}-{pid}.jsonl"


def run_file(cfg: LogConfig, started: float, pid: int) -> str:
    """The file this run logs to: `log.file`, else a new file in `log.dir`, else "" (none)."""
    if cfg.file:
        return os.path.abspath(os.path.expanduser(cfg.file))
    if not cfg.dir:
        return ""
    folder = os.path.abspath(os.path.expanduser(cfg.dir))
    return os.path.join(folder, run_file_name(started, pid))


def prepare_run_file(cfg: LogConfig, started: float, pid: int) -> str:
    """Resolve the file, make its folder, drop the oldest runs beyond `log.keep_runs` (only for
    files named by us in `log.dir`). Raises OSError when the folder cannot be written."""
    path = run_file(cfg, started, pid)
    if not path:
        return ""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    if not cfg.file:
        prune_runs(Path(path).parent, cfg.keep_runs - 1)
    with open(path, "a", encoding="utf-8"):
        pass  # exists before any actor opens it: writable, or OSError here
    return path


def prune_runs(folder: Path, keep: int) -> list[Path]:
    """Delete every file of all but the newest `keep` runs in `folder` (run file and its rotated
    backups); files not named like a run file are left alone. Returns what was deleted."""
    runs: dict[str, list[Path]] = {}
    for entry in folder.iterdir():
        match = RUN_FILE.match(entry.name)
        if match and entry.is_file():
            runs.setdefault(match.group(1), []).append(entry)
    gone: list[Path] = []
    for stem in sorted(runs, key=_run_order)[:max(0, len(runs) - keep)]:
        for entry in runs[stem]:
            try:
                entry.unlink()
                gone.append(entry)
            except FileNotFoundError:
                pass
    return gone


def _run_order(stem: str) -> tuple[str, int]:
    day, clock, pid = stem.split("-")
    return day + clock, int(pid)


def backups(path: str | Path) -> list[Path]:
    """The rotated files of `path` that exist, oldest first (FILE.N ... FILE.1)."""
    path = Path(path)
    found = []
    for entry in path.parent.glob(path.name + ".*"):
        suffix = entry.name[len(path.name) + 1:]
        if suffix.isdigit():
            found.append((int(suffix), entry))
    return [entry for _, entry in sorted(found, reverse=True)]


def rotate(path: str | Path, max_bytes: int, keep: int) -> bool:
    """When `path` is past max_bytes: FILE.(keep-1) -> FILE.keep ... FILE -> FILE.1 (renames,
    the oldest replaced), or with keep 0 cut FILE to empty (writers append at the new end).
    Writers reopen FILE on their own (actors/logs.py AppendFile). True when it rotated."""
    path = Path(path)
    try:
        if path.stat().st_size < max_bytes:
            return False
    except FileNotFoundError:
        return False
    if keep == 0:
        os.truncate(path, 0)
        return True
    for n in range(keep - 1, 0, -1):
        older = path.with_name(f"{path.name}.{n}")
        if older.exists():
            os.replace(older, path.with_name(f"{path.name}.{n + 1}"))
    os.replace(path, path.with_name(f"{path.name}.1"))
    return True


def latest_run(folder: str | Path) -> Path | None:
    """The newest run file in a log folder (for `launch logs` without a FILE)."""
    folder = Path(folder).expanduser()
    if not folder.is_dir():
        return None
    stems = [m.group(1) for e in folder.iterdir() if (m := RUN_FILE.match(e.name))
             and m.group(2) is None]
    return folder / f"{max(stems, key=_run_order)}.jsonl" if stems else None
