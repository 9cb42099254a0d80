"""The servers the benchmark compares, started one at a time on the same model directory:
this graph (`launch`), `mlx_lm.server` and, where its venv is given, vllm-mlx (`vllm-mlx serve
--continuous-batching`, in a venv of its own: `python -m venv V && V/bin/pip install vllm-mlx
"mlx[cpu]"`). All run MLX with the same BLAS (runtime.blas), so the comparison is of the
servers, not of their matmul libraries."""

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
        yield Target("mlx-actor-serve", graph.http + "/v1", graph.model, {"ignore_eos": True},
                     graph.proc.pid)
    finally:
        stop_graph(graph.proc)


# vllm-mlx in its own venv's Python: our BLAS found here (its venv has no MKL), its path
# loaded there first by blas.load_library (stdlib only, importable from the repository root,
# its working directory), then its command line.
_VLLM_MLX = ("import sys; from actors.model_runner.cpu import blas; "
             "blas.load_library(sys.argv.pop(1) or None); "
             "from vllm_mlx.cli import main; sys.argv[0] = 'vllm-mlx'; sys.exit(main())")


@contextlib.contextmanager
def mlx_lm_server(model_dir: str, blas: str, eos_ids: list[int],
                  timeout: float = 300) -> Iterator[Target]:
    port = _free_port()
    args = [sys.executable, "-c", _MLX_LM, blas, "--model", model_dir, "--host", "127.0.0.1",
            "--port", str(port), "--log-level", "WARNING"]
    # It has no ignore_eos: a large negative bias on EOS gives the same fixed lengths.
    with _serving("mlx_lm.server", args, port, timeout):
        yield Target("mlx_lm.server", f"http://127.0.0.1:{port}/v1", "default_model",
                     {"logit_bias": {str(t): -1e9 for t in eos_ids}})


@contextlib.contextmanager
def vllm_mlx_server(python: str, model_dir: str, blas_path: str | None, eos_ids: list[int],
                    timeout: float = 300) -> Iterator[Target]:
    """vllm-mlx with continuous batching, run by `python` (its venv's interpreter)."""
    port = _free_port()
    args = [python, "-c", _VLLM_MLX, blas_path or "", "serve", model_dir, "--host",
            "127.0.0.1", "--port", str(port), "--continuous-batching"]
    with _serving("vllm-mlx", args, port, timeout):
        yield Target("vllm-mlx", f"http://127.0.0.1:{port}/v1", model_dir,
                     {"logit_bias": {str(t): -1e9 for t in eos_ids}})


@contextlib.contextmanager
def _serving(name: str, args: list[str], port: int, timeout: float) -> Iterator[None]:
    """Start a server process and wait until it answers /v1/models; stop it after."""
    # Its log goes to a file: a pipe nobody reads would fill and stall it.
    log = tempfile.TemporaryFile("w+")
    proc = subprocess.Popen(args, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=log, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout
        while True:
            if proc.poll() is not None:
                log.seek(0)
                raise RuntimeError(f"{name} exited with {proc.returncode}: "
                                   f"{log.read()[-2000:]}")
            try:
                with urllib.request.urlopen(url + "/v1/models", timeout=5):
                    break
            except OSError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{name} did not answer /v1/models") from None
                time.sleep(0.5)
        yield
    finally:
        stop_graph(proc)
        log.close()
