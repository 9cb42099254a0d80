"""The BLAS behind MLX's matmuls: chosen by runtime.blas, loaded before mlx, and really used
(MKL_VERBOSE makes MKL print each call it serves)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from actors.model_runner.cpu import blas
from harness.graph import ROOT

LINUX_X86 = sys.platform.startswith("linux") and os.uname().machine == "x86_64"

MATMUL = """
import sys
from actors.model_runner.cpu import blas
print("loaded", blas.load(sys.argv[1]))
import mlx.core as mx
a = mx.ones((64, 64))
mx.eval(a @ a)
print("sum", (a @ a).sum().item())
"""


def _run(choice: str) -> str:
    env = dict(os.environ, MKL_VERBOSE="1")
    out = subprocess.run([sys.executable, "-c", MATMUL, choice], env=env, cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "sum 262144.0" in out.stdout  # 64 * 64 * 64: right either way
    return out.stdout


@pytest.mark.skipif(not LINUX_X86, reason="the mkl wheel is a Linux x86-64 dependency")
def test_mkl_serves_mlx_matmuls_when_chosen():
    out = _run("mkl")
    assert "libmkl_rt" in out and "SGEMM(" in out


@pytest.mark.skipif(not LINUX_X86, reason="the mkl wheel is a Linux x86-64 dependency")
def test_auto_picks_mkl_and_bundled_keeps_the_reference_blas():
    assert "libmkl_rt" in blas.find("auto")
    assert "SGEMM(" not in _run("bundled")


def test_bad_choices_are_named():
    with pytest.raises(ValueError, match="runtime.blas: 'fast' is not one of"):
        blas.find("fast")
    assert blas.find("bundled") is None


def test_loading_after_mlx_is_refused():
    code = ("import mlx.core\nfrom actors.model_runner.cpu import blas\n"
            "try:\n    blas.load('auto')\nexcept RuntimeError as e:\n    print(e)\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    assert "before mlx is imported" in out.stdout


@pytest.mark.skipif(not LINUX_X86, reason="the mkl wheel is a Linux x86-64 dependency")
@pytest.mark.parametrize("given, seen", [(None, "KMP_BLOCKTIME=0"), ("5ms", "KMP_BLOCKTIME=5ms")])
def test_mkl_threads_sleep_between_products_unless_told_otherwise(given, seen):
    # KMP_SETTINGS makes Intel OpenMP print the settings it runs with when it starts.
    env = {k: v for k, v in os.environ.items() if k != "KMP_BLOCKTIME"}
    env["KMP_SETTINGS"] = "1"
    if given:
        env["KMP_BLOCKTIME"] = given
    out = subprocess.run([sys.executable, "-c", MATMUL, "mkl"], env=env, cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    settings = [line.strip() for line in (out.stdout + out.stderr).splitlines()
                if line.strip().startswith("KMP_BLOCKTIME=")]
    assert settings and settings[0] in (seen, seen + "ms"), settings
