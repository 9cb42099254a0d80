"""What config.json tells every actor about a model's layers (models/info.py): which layers
keep a fixed-size state (recurrent states, sliding windows: the state slots) and how many
bytes a token takes in the layers whose KV grows with the context (the KV slots)."""

import json

import pytest

from models.info import layer_kinds, read_model_info

BASE = {"num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 16, "hidden_size": 64, "vocab_size": 100, "torch_dtype": "bfloat16"}


def info(tmp_path, **config):
    (tmp_path / "config.json").write_text(json.dumps({**BASE, **config}))
    return read_model_info(str(tmp_path))


@pytest.mark.parametrize("config, kinds", [
    ({}, ["full"] * 4),
    ({"full_attention_interval": 2}, ["linear", "full", "linear", "full"]),  # Qwen3.5
    ({"sliding_window": 32, "sliding_window_pattern": 2},  # Gemma 3
     ["sliding", "full", "sliding", "full"]),
    ({"sliding_window_pattern": 2}, ["full"] * 4),  # no window: no sliding layer
    ({"layer_types": ["sliding_attention", "full_attention"] * 2},  # gpt-oss, Ministral
     ["sliding", "full", "sliding", "full"]),
    ({"layer_types": ["full_attention"] * 4, "sliding_window": 8}, ["full"] * 4),
])
def test_layer_kinds_follow_the_config(config, kinds):
    get = lambda key, default=None: {**BASE, **config}.get(key, default)  # noqa: E731
    assert layer_kinds(get) == kinds


def test_state_layers_and_kv_bytes_count_the_right_layers(tmp_path):
    dense = info(tmp_path)
    assert dense.state_layers == 0
    assert dense.kv_bytes_per_token == 2 * 4 * 2 * 16 * 2  # K and V, 4 layers, bf16
    gemma = info(tmp_path, sliding_window=32, sliding_window_pattern=2)
    assert gemma.state_layers == 2  # the windows go to the state slots
    assert gemma.kv_bytes_per_token == dense.kv_bytes_per_token // 2  # full layers only
    hybrid = info(tmp_path, full_attention_interval=4)
    assert (hybrid.state_layers, hybrid.kv_bytes_per_token) == (3, dense.kv_bytes_per_token // 4)


def test_every_eos_id_the_model_files_name_is_kept(tmp_path):
    """Llama 3 lists several EOS ids in config.json, generation_config.json adds more, and
    tokenizer_config.json names its eos token by text: a request stops at any of them."""
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 9]}))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|eot|>"}))
    (tmp_path / "tokenizer.json").write_text(json.dumps(
        {"added_tokens": [{"id": 11, "content": "<|eot|>"}, {"id": 12, "content": "<|x|>"}]}))
    assert info(tmp_path, eos_token_id=[9, 3]).eos_ids == [3, 7, 9, 11]
