"""A model whose layers the runner cannot serve is refused at launch, by layer and cache type,
before any request can fail on it (actors/model_runner/layers.py classify)."""

import json
import shutil

import pytest

from harness.graph import start_graph
from models.builtin import ensure_builtin

# Llama 4's text model: three of every four layers attend within chunks of
# attention_chunk_size positions, kept in mlx-lm's ChunkedKVCache, which has no batched form.
LLAMA4_TEXT = dict(
    model_type="llama4_text", hidden_size=64, intermediate_size=128, intermediate_size_mlp=128,
    num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    vocab_size=151936, max_position_embeddings=4096, rope_theta=500_000.0, num_local_experts=1,
    num_experts_per_tok=1, interleave_moe_layer_step=1, no_rope_layers=[1, 1, 1, 0],
    attention_chunk_size=32, use_qk_norm=True, rms_norm_eps=1e-5, attention_bias=False,
    moe_layers=[], rope_scaling=None, floor_scale=8192, attn_scale=0.1,
)  # fmt: skip


def llama4_dir(folder, model_cache):
    """A tiny Llama 4 from mlx-lm's own class (its weights need not mean anything: it never
    runs a token) with the Qwen 3 tokenizer."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.models import llama4

    config = {"model_type": "llama4", "text_config": LLAMA4_TEXT}
    model = llama4.Model(llama4.ModelArgs.from_dict(config))
    mx.save_safetensors(str(folder / "model.safetensors"), dict(tree_flatten(model.parameters())))
    (folder / "config.json").write_text(json.dumps(config))
    tokenizer = ensure_builtin("qwen3-tiny", cache_dir=model_cache, progress=False)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer / name, folder / name)
    return folder


def test_a_layer_kind_the_runner_cannot_batch_is_refused_at_launch_by_name(tmp_path,
                                                                            model_cache):
    (tmp_path / "llama4-tiny").mkdir()
    folder = llama4_dir(tmp_path / "llama4-tiny", model_cache)
    lines: list[str] = []
    with pytest.raises(RuntimeError, match="did not start"):
        start_graph(f"model.path={folder}", on_log=lines.append, ready_timeout=120)
    text = "\n".join(lines)
    assert "layers 0, 1, 2 (ChunkedKVCache)" in text, text[-3000:]
