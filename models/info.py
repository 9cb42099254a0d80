"""What every process knows about the served model, read from its folder without MLX: the
launcher reads it once and hands it to every actor."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec


class ModelInfo(msgspec.Struct, frozen=True):
    """Facts about the served model that the launcher reads once and hands to every actor."""

    path: str
    name: str  # what clients call it (model.name, the repo id, the folder's or built-in's name)
    context_length: int
    eos_ids: list[int]
    vocab_size: int
    model_type: str
    kv_bytes_per_token: int = 0  # KV memory one token takes across the attention layers
    kv_value_bytes: int = 2  # of one K or V value, in the checkpoint's dtype
    revision: str = ""  # the commit of a model resolved from a Hugging Face repo id
    # layers whose memory per request is fixed (a recurrent state, a sliding window): what a
    # state slot holds for them
    state_layers: int = 0
    attention_heads: int = 0  # query heads of an attention layer (the workspace's scores)
    # how the launcher chose scheduler.max_running_requests (launch/sizing.py)
    sizing: str = ""


def _ids(value) -> list[int]:
    if value is None:
        return []
    return [value] if isinstance(value, int) else [int(v) for v in value]


def read_model_info(path: str, name: str = "", context_length: int = 0) -> ModelInfo:
    """Context length, EOS ids and vocab size from config.json, generation_config.json and the
    tokenizer's eos token, so every actor agrees on them without loading the model."""
    folder = Path(path)
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(f"{folder} is not an mlx-lm model directory (no config.json)")
    config = json.loads((folder / "config.json").read_text())
    text = config.get("text_config", {})  # multimodal configs nest the language model's keys
    eos = _ids(config.get("eos_token_id", text.get("eos_token_id")))
    gen = folder / "generation_config.json"
    if gen.is_file():
        eos += _ids(json.loads(gen.read_text()).get("eos_token_id"))
    tok_cfg = folder / "tokenizer_config.json"
    tok_json = folder / "tokenizer.json"
    if tok_cfg.is_file() and tok_json.is_file():
        eos_token = json.loads(tok_cfg.read_text()).get("eos_token")
        if isinstance(eos_token, dict):
            eos_token = eos_token.get("content")
        for added in json.loads(tok_json.read_text()).get("added_tokens", []):
            if added.get("content") == eos_token:
                eos.append(int(added["id"]))
    max_pos = config.get("max_position_embeddings", text.get("max_position_embeddings", 4096))
    get = lambda key, default=None: config.get(key, text.get(key, default))  # noqa: E731
    vocab = config.get("vocab_size", text.get("vocab_size", 0))
    return ModelInfo(path=str(folder), name=name or folder.name,
                     context_length=context_length or int(max_pos),
                     eos_ids=sorted(set(eos)), vocab_size=int(vocab),
                     model_type=config.get("model_type", ""),
                     kv_bytes_per_token=_kv_bytes_per_token(get),
                     kv_value_bytes=_value_bytes(get),
                     state_layers=_state_layers(get),
                     attention_heads=int(get("num_attention_heads", 0) or 0))


def layer_kinds(get) -> list[str]:
    """Each layer's attention as config.json tells it: "full", "linear" (a recurrent state) or
    "sliding" (a window). From `layer_types` where the config lists them, else from the
    patterns of Qwen3.5 (`full_attention_interval`) and Gemma 3 (`sliding_window_pattern`)."""
    layers = int(get("num_hidden_layers", 0))
    types = get("layer_types")
    if isinstance(types, list) and len(types) == layers:
        named = {"linear_attention": "linear", "sliding_attention": "sliding"}
        return [named.get(t, "full") for t in types]
    if interval := get("full_attention_interval"):
        return ["full" if (i + 1) % int(interval) == 0 else "linear" for i in range(layers)]
    if (pattern := get("sliding_window_pattern")) and get("sliding_window"):
        return ["full" if (i + 1) % int(pattern) == 0 else "sliding" for i in range(layers)]
    return ["full"] * layers


def _state_layers(get) -> int:
    return sum(1 for kind in layer_kinds(get) if kind != "full")


_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


def _kv_bytes_per_token(get) -> int:
    """K and V of one token in every full-attention layer. Hybrid and sliding-window models
    keep a fixed-size state or window in their other layers (the state slots')."""
    layers = layer_kinds(get).count("full")
    heads = int(get("num_key_value_heads") or get("num_attention_heads", 0))
    head_dim = get("head_dim") or int(get("hidden_size", 0)) // max(1, int(get(
        "num_attention_heads", 1)))
    return 2 * layers * heads * int(head_dim) * _value_bytes(get)


def _value_bytes(get) -> int:
    return _DTYPE_BYTES.get(str(get("torch_dtype") or get("dtype") or "float16"), 2)
