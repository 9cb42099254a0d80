"""A value one thread sets for the length of a with-block.

How the runner's step tells code deep inside mlx-lm's forward what it is doing (the patched
modules of cpu/, the pipeline's before-host-sync hook) without passing it through mlx-lm's call
signatures. Per thread, because the same process's stock mlx-lm (the tests' oracle, the
benchmarks' bare forward) must not see the runner's settings.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Generic, Iterator, TypeVar

T = TypeVar("T")


class ThreadFlag(Generic[T]):
    def __init__(self, default: T):
        self.default = default
        self._local = threading.local()

    def get(self) -> T:
        return getattr(self._local, "value", self.default)

    def set(self, value: T) -> None:
        self._local.value = value

    @contextmanager
    def holding(self, value: T) -> Iterator[None]:
        """`value` on this thread inside the block, the previous one after it."""
        saved = self.get()
        self.set(value)
        try:
            yield
        finally:
            self.set(saved)
