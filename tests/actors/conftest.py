import pytest

from models.builtin import ensure_builtin
from models.info import ModelInfo, read_model_info


@pytest.fixture(scope="session")
def tiny_model(model_cache) -> ModelInfo:
    """qwen3-tiny (the real Qwen tokenizer), built once per machine or per pytest run."""
    path = ensure_builtin("qwen3-tiny", cache_dir=model_cache, progress=False)
    return read_model_info(str(path), name="qwen3-tiny")


@pytest.fixture(scope="session")
def tokenizer(tiny_model):
    """The tokenizer the actors load (models.tokenizer), for the tests' own encoding."""
    from models.tokenizer import load_tokenizer

    return load_tokenizer(tiny_model.path)
