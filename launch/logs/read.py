"""Reading a run's log: the file and its rotated backups, into records in time order; and
following a live file (tail -F: it survives the launcher's rotation)."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Callable, Iterator, TextIO

from actors.logs import AppendFile
from launch.logs.events import Record, in_order, parse_line
from launch.logs.files import backups


def read_records(path: str | Path, with_backups: bool = True) -> list[Record]:
    """Every record of FILE (and FILE.N ... FILE.1 before it, oldest first), in time order."""
    files = [*backups(path), Path(path)] if with_backups else [Path(path)]
    records: list[Record] = []
    for f in files:
        try:
            with open(f, encoding="utf-8", errors="replace") as lines:
                for line in lines:
                    if rec := parse_line(line, len(records)):
                        records.append(rec)
        except FileNotFoundError:
            if f == Path(path):
                raise
    return in_order(records)


def first_record(path: str | Path) -> list[Record]:
    """The first record of FILE (or none), without reading the rest."""
    with open(path, encoding="utf-8", errors="replace") as lines:
        for line in lines:
            if rec := parse_line(line):
                return [rec]
    return []


class _Tail:
    """One open file, read line by line; a line still being written waits for its end."""

    def __init__(self, handle: TextIO):
        self.handle, self.partial = handle, ""
        self.inode = os.fstat(handle.fileno()).st_ino

    def lines(self) -> Iterator[str]:
        for chunk in iter(self.handle.readline, ""):
            if not chunk.endswith("\n"):
                self.partial += chunk
                continue
            line, self.partial = self.partial + chunk, ""
            yield line


def follow(path: str | Path, stop: Callable[[], bool] = lambda: False,
           poll_s: float = 0.2, from_start: bool = False) -> Iterator[Record]:
    """Records appended to FILE from now on (from its start with from_start), as they come,
    until stop() is true (asked while waiting). When the launcher rotates FILE, the writers
    move to the new file within AppendFile.CHECK_S: the old one is read to its end after that,
    then the new one from its start. A file cut to empty (log.backups 0) is read from its
    start again."""
    path, tail, seq = Path(path), None, 0
    while True:
        if tail is None:
            try:
                tail = _Tail(open(path, encoding="utf-8", errors="replace"))
            except FileNotFoundError:
                pass  # between the rename and a writer's next line
            else:
                if not from_start:
                    tail.handle.seek(0, os.SEEK_END)
                from_start = True  # a file that replaces this one is read whole
        got = False
        for line in tail.lines() if tail is not None else ():
            got = True
            if rec := parse_line(line, seq):
                seq += 1
                yield rec
        if got:
            continue
        if stop():
            break
        if tail is not None:
            size = _size_of(path, tail.inode)
            if size is None:  # renamed: let the writers move, read what they left, go on
                time.sleep(AppendFile.CHECK_S + 0.1)
                for line in tail.lines():
                    if rec := parse_line(line, seq):
                        seq += 1
                        yield rec
                tail.handle.close()
                tail = None
                continue
            if size < tail.handle.tell():  # cut to empty: start over
                tail.handle.seek(0)
                tail.partial = ""
                continue
        time.sleep(poll_s)
    if tail is not None:
        tail.handle.close()


def _size_of(path: Path, inode: int) -> int | None:
    """FILE's size, or None when the path no longer names the file we read."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    return st.st_size if st.st_ino == inode else None
