import os
from pathlib import Path

import pytest

from actors.model_runner.cpu import blas
from models import builtin

# The oracle (mlx_lm.generate in this process) and the servers' runners use the same BLAS,
# so their float32 sums are done by the same kernels. Before anything imports mlx.
blas.load("auto")


@pytest.fixture(scope="session")
def model_cache(tmp_path_factory) -> Path:
    """Built-in models are built once per machine (MAS_CACHE_DIR) or once per test session."""
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
