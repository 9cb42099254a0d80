import pytest

from harness.graph import Graph
from models.builtin import ensure_builtin


@pytest.fixture(scope="module")
def graph(model_cache):
    """The real graph on qwen3-tiny with the default config, one per test module."""
    ensure_builtin("qwen3-tiny", cache_dir=model_cache, progress=False)
    g = Graph("model.builtin=qwen3-tiny")
    yield g
    assert g.stop() == 0
