import multiprocessing.process
import os
import subprocess
from pathlib import Path

import pytest

from actors.model_runner.cpu import blas
from models import builtin

# The oracle (mlx_lm.generate in this process) and the servers' runners use the same BLAS,
# so their float32 sums are done by the same kernels. Before anything imports mlx.
blas.load("auto")

# Layers whose every test starts processes or loads a real model: `slow` by where they live.
SLOW_LAYERS = {"runner", "actors", "e2e"}
# Fixtures that build or load a real model or start the graph: `slow` wherever they are used.
SLOW_FIXTURES = {"model_cache", "loaded", "graph", "tiny_model"}


def pytest_collection_modifyitems(config, items):
    for item in items:
        layer = Path(str(item.path)).relative_to(Path(__file__).parent).parts[0]
        if layer in SLOW_LAYERS or SLOW_FIXTURES.intersection(item.fixturenames):
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="session", autouse=True)
def fast_layer_starts_no_process(request):
    """With `-m "not slow"` (make test-fast) a test that starts a process fails, naming it:
    the fast layer is the one that starts none."""
    if "not slow" not in (request.config.getoption("markexpr") or ""):
        yield
        return

    def refuse(*args, **kwargs):
        raise RuntimeError("a test outside the slow layers started a process: mark it slow "
                           "(tests/conftest.py)")

    saved = subprocess.Popen._execute_child, multiprocessing.process.BaseProcess.start
    subprocess.Popen._execute_child = refuse
    multiprocessing.process.BaseProcess.start = refuse
    yield
    subprocess.Popen._execute_child, multiprocessing.process.BaseProcess.start = saved


@pytest.fixture(scope="session")
def model_cache(tmp_path_factory) -> Path:
    """Built-in models are built once per machine (MAS_CACHE_DIR) or once per pytest run."""
    env = os.environ.get("MAS_CACHE_DIR")
    path = Path(env) if env else tmp_path_factory.mktemp("models")
    os.environ["MAS_CACHE_DIR"] = str(path)  # launched graphs find the same models
    return path


@pytest.fixture(scope="session")
def loaded(model_cache):
    """name -> (directory, model, tokenizer), each built and loaded once per session."""
    import mlx_lm

    cache = {}

    def load(name):
        if name not in cache:
            directory = builtin.ensure_builtin(name, model_cache, progress=False)
            cache[name] = (directory, *mlx_lm.load(str(directory)))
        return cache[name]

    return load


@pytest.fixture(scope="session")
def graph(model_cache):
    """The real graph on qwen3-tiny with the default config, one for the whole pytest run:
    starting one takes seconds, and tests that share it leave nothing behind that another
    could see (each request is its own; counters are read as differences)."""
    from harness.graph import Graph

    builtin.ensure_builtin("qwen3-tiny", cache_dir=model_cache, progress=False)
    g = Graph("model.builtin=qwen3-tiny")
    yield g
    assert g.stop() == 0
