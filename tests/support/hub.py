"""Models in a Hugging Face cache layout, made offline from built-in models."""

from __future__ import annotations

import shutil
from pathlib import Path

REV_MAIN = "a" * 40
REV_OLD = "b" * 40


def cache_model(hub_cache: Path, repo: str, source: Path, rev: str, main: bool) -> Path:
    """A model in the library's own cache layout, as `hf download` leaves it."""
    folder = hub_cache / f"models--{repo.replace('/', '--')}"
    snapshot = folder / "snapshots" / rev
    shutil.copytree(source, snapshot)
    if main:
        (folder / "refs").mkdir(parents=True, exist_ok=True)
        (folder / "refs" / "main").write_text(rev)
    return snapshot
