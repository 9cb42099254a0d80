"""The servers the benchmark compares, started one at a time on the same model directory:
this graph (`launch`) and `mlx_lm.server`. Both run MLX with the same BLAS (runtime.blas), so
the comparison is of the servers, not of their matmul libraries."""

from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from typing import Iterator

from benchmarks.serving.load import Target
from harness.graph import ROOT, start_graph, stop_graph

# mlx_lm.server in a process that loaded the BLAS first (blas.load must precede mlx).
_MLX_LM = ("import sys; from actors.model_runner.cpu import blas; blas.load(sys.argv.pop(1)); "
           "import runpy; sys.argv[0] = 'mlx_lm.server'; "
           "runpy.run_module('mlx_lm.server', run_name='__main__')")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def ours(model_dir: str, blas: str, overrides: list[str] = ()) -> Iterator[Target]:
    graph = start_graph(f"model.path={model_dir}", f"runtime.blas={blas}", *overrides)
    try:
        yield Target("mlx-actor-serve", graph.http + "/v1", graph.model, {"ignore_eos": True})
    finally:
        stop_graph(graph.proc)


@contextlib.contextmanager
def mlx_lm_server(model_dir: str, blas: str, eos_ids: list[int],
                  timeout: float = 300) -> Iterator[Target]:
    port = _free_port()
    args = [sys.executable, "-c", _MLX_LM, blas, "--model", model_dir, "--host", "127.0.0.1",
            "--port", str(port), "--log-level", "WARNING"]
    # Its log goes to a file: a pipe nobody reads would fill and stall it.
    log = tempfile.TemporaryFile("w+")
    proc = subprocess.Popen(args, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=log, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout
        while True:
            if proc.poll() is not None:
                log.seek(0)
                raise RuntimeError(f"mlx_lm.server exited with {proc.returncode}: "
                                   f"{log.read()[-2000:]}")
            try:
                with urllib.request.urlopen(url + "/v1/models", timeout=5):
                    break
            except OSError:
                if time.monotonic() > deadline:
                    raise RuntimeError("mlx_lm.server did not answer /v1/models") from None
                time.sleep(0.5)
        # It has no ignore_eos: a large negative bias on EOS gives the same fixed lengths.
        yield Target("mlx_lm.server", url + "/v1", "default_model",
                     {"logit_bias": {str(t): -1e9 for t in eos_ids}})
    finally:
        stop_graph(proc)
        log.close()
