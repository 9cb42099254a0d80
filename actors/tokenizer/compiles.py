"""Grammars compiled off the tokenizer's event loop.

A constraint (json_schema, regex, ebnf, structural_tag) compiles on a thread of its own, so a slow
grammar holds up neither the streams nor the HTTP server; the loop learns that a compile ended
from `wake`, called on the compiling thread. A compile past limits.grammar_timeout_s is abandoned
by the request (refused, naming the limit), not by its thread: Python cannot stop a thread, so
it runs on to its end, and the next compile gets a thread of its own instead of queueing behind
it. At most `most` threads compile at once; past that a request is refused with a 503 until one
ends, so abandoned compiles cannot pile up threads without bound.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future
from typing import Callable

from actors import constraints


class Compiles:
    def __init__(self, most: int = 4):
        self.most = most
        self._running: set[threading.Thread] = set()

    @property
    def running(self) -> int:
        """Compiles whose threads have not ended, abandoned ones included."""
        self._running = {t for t in self._running if t.is_alive()}
        return len(self._running)

    def start(self, kind: str, source: str, specials: frozenset[str],
              wake: Callable[[], None]) -> Future | None:
        """The compiled grammar as a future that `wake` announces (called on the compiling
        thread once it is set); None when `most` compiles are running already."""
        if self.running >= self.most:
            return None
        job: Future = Future()
        job.add_done_callback(lambda _: wake())

        def run() -> None:
            try:
                # Looked up at call time: the module's function, as a test may replace it.
                job.set_result(constraints.compile_constraint(kind, source, specials))
            except BaseException as e:  # GrammarError, or a bug: the request's reply says
                job.set_exception(e)

        thread = threading.Thread(target=run, name=f"grammar-{kind}", daemon=True)
        self._running.add(thread)
        thread.start()
        return job
