import pytest

from models.builtin import ensure_builtin
from models.info import ModelInfo, read_model_info


@pytest.fixture(scope="session")
def tiny_model(model_cache) -> ModelInfo:
    """qwen3-tiny (the real Qwen tokenizer), built once per machine or per session."""
    path = ensure_builtin("qwen3-tiny", cache_dir=model_cache, progress=False)
    return read_model_info(str(path), name="qwen3-tiny")
