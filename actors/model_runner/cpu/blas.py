"""An optimized BLAS for MLX on Linux, chosen by `runtime.blas`.

The Linux `mlx-cpu` wheel links a reference BLAS (netlib), whose float32 matmuls are 10-20x
slower than an optimized one. A library loaded with RTLD_GLOBAL before MLX is imported
supplies `cblas_sgemm` and friends to MLX in its place: no system package, no LD_PRELOAD.
The `mkl` wheel (a Linux dependency of this package) puts `libmkl_rt` in `<prefix>/lib`;
Debian's OpenBLAS is used where it is installed. Must run before anything imports mlx.

This module imports nothing heavy: the runner's entry point calls it first.
"""

from __future__ import annotations

import ctypes
import glob
import os
import sys

CHOICES = ("auto", "mkl", "openblas", "bundled")
_OPENBLAS = ("/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0",
             "/usr/lib/x86_64-linux-gnu/libopenblas.so.0",
             "/usr/lib/aarch64-linux-gnu/openblas-pthread/libopenblas.so.0",
             "/usr/lib/aarch64-linux-gnu/libopenblas.so.0")

_loaded: str | None = None  # what this process loaded (a path, or "bundled")


def find(choice: str) -> str | None:
    """The library `choice` names on this machine (None: MLX's own). Raises ValueError when
    a library asked for by name is not here, saying how to get it."""
    if choice not in CHOICES:
        raise ValueError(f"runtime.blas: {choice!r} is not one of {', '.join(CHOICES)}")
    if choice == "bundled" or not sys.platform.startswith("linux"):
        return None  # macOS: MLX uses Accelerate and Metal; nothing to swap
    mkl = _mkl()
    if choice == "mkl" and mkl is None:
        raise ValueError("runtime.blas = 'mkl' but libmkl_rt is not installed here "
                         "(pip install mkl)")
    openblas = next((p for p in _OPENBLAS if os.path.exists(p)), None)
    if choice == "openblas" and openblas is None:
        raise ValueError("runtime.blas = 'openblas' but no OpenBLAS library is installed "
                         "(Debian: apt install libopenblas0-pthread)")
    if choice == "openblas":
        return openblas
    return mkl if choice == "mkl" else (mkl or openblas)


def _mkl() -> str | None:
    for prefix in dict.fromkeys((sys.prefix, sys.base_prefix)):
        found = sorted(glob.glob(os.path.join(prefix, "lib", "libmkl_rt.so*")))
        if found:
            return found[-1]
    return None


def load(choice: str) -> str:
    """Load the chosen BLAS into this process before MLX; returns what is in use. Once per
    process: a second call only reports."""
    global _loaded
    if _loaded is not None:
        return _loaded
    if "mlx.core" in sys.modules:
        raise RuntimeError("blas.load() must run before mlx is imported")
    _loaded = load_library(find(choice))
    return _loaded


def load_library(path: str | None) -> str:
    """Load the BLAS at `path` (None: keep MLX's own) into this process, before MLX; returns
    what is in use. load() without the choosing, for a process that was given the path (a
    benchmark peer in a venv of its own)."""
    if path is not None and "libmkl" in path:
        # One MKL thread per core by default; GNU OpenMP would clash with none of ours, but
        # Intel's is what the wheel ships (intel-openmp).
        os.environ.setdefault("MKL_THREADING_LAYER", "INTEL")
        # Intel OpenMP's idle threads spin 200 ms after each parallel region by default: with a
        # step every few ms they never sleep, and on a small machine the spinning core is the
        # one our kernels' pool, MLX's stream thread, the other actors and the clients need.
        # Sleeping at once, qwen3-tiny at 128 streams: 1,878 -> 3,098 tok/s, the runner's CPU
        # 1.53 -> 1.12 cores; qwen3-small at 1/16/64 streams: the same rates within noise, the
        # runner 1.8 -> 1.3 cores at 16-64 (served, 128-token prompts and outputs as
        # benchmarks.serving.crowd sends them; prefill: below). A KMP_BLOCKTIME of the user's
        # wins.
        os.environ.setdefault("KMP_BLOCKTIME", "0")
    if path is not None:
        ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
    return path or "bundled"


def in_use() -> str:
    """What load() loaded in this process ("bundled" if it was never called)."""
    return _loaded or "bundled"
