"""Built-in models: real Qwen (and Gemma 3) architectures with the real Qwen tokenizer and seeded
random weights.

Nothing can be downloaded, so the engine serves models it builds itself. A built-in is a local
mlx-lm directory (config.json, model.safetensors in float32, tokenizer files) made once per spec;
its 4-bit, 8-bit and bf16 variants are made from it by mlx-lm's converter (models/formats.py).

Plain random init makes greedy decoding repeat one token: with tied embeddings the residual stream is
mostly the input token's own embedding, so the input token wins the argmax. The init below makes every
block write much more than the embedding into the residual stream, so the next token is a pseudo-random
function of the context, and scales the final norm so the logits spread by several units (top-2 gaps far
above float noise). tests/runner/test_builtin_model.py measures both properties. Gemma's norms scale
by 1 + weight and also normalize what each block writes; the same scales, stored minus one, keep
its continuations as varied. FAMILIES are tiny models of other architectures (Llama, Qwen 2,
Qwen3-MoE, Phi-3, gpt-oss, Ministral 3, DeepSeek-V3) for tests, built the same way.
"""

import copy
import hashlib
import importlib
import json
import os
import shutil
import sys
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np
from tqdm import tqdm

from models import formats
from models.qwen_bpe import VOCABS, write_tokenizer

# Bump when the build itself changes (init rules, file layout): every cached model then rebuilds.
BUILD_VERSION = 3  # 3: the chat template speaks tools and thinking


@dataclass(frozen=True)
class ModelSpec:
    """Everything that determines a built-in's files; its hash names the cache directory."""

    vocab: str  # a key of qwen_bpe.VOCABS
    config: dict = field(default_factory=dict)  # architecture fields of config.json
    embed_std: float = 0.02
    residual_gain: float = 4.0  # std of the projections that write the residual stream, x 1/sqrt(fan_in)
    qk_norm: float = 2.0  # q_norm/k_norm weight; attention logits scale with its square
    logit_std: float = 8.0  # sets the final RMSNorm weight: logit std ~ weight * embed_std * sqrt(hidden)
    # The end-of-turn token's embedding row (tied: also its logit row) times this: above 1,
    # replies end by themselves after a few tokens, as a chat model's do (4: ~1 in 9 tokens).
    end_gain: float = 1.0
    # A variant of another built-in: its weights are seeded by that one's name (the same but
    # for what the variant changes). Empty: by its own name.
    weights_of: str = ""


_QWEN3_5_ROPE = {"rope_type": "default", "rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25}

# qwen3-tiny (the tests' model) and qwen3-small (the default) take Qwen3's own context, 40960
# tokens: a coding agent's first prompt alone is 15-30k.
BUILTINS: dict[str, ModelSpec] = {
    "qwen3-tiny": ModelSpec(
        vocab="qwen3",
        config=dict(
            model_type="qwen3", hidden_size=64, intermediate_size=192, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=32, vocab_size=151936,
            max_position_embeddings=40960, rope_theta=1_000_000.0, tie_word_embeddings=True,
        ),
    ),
    "qwen3-small": ModelSpec(
        vocab="qwen3",
        config=dict(
            model_type="qwen3", hidden_size=512, intermediate_size=1536, num_hidden_layers=8,
            num_attention_heads=8, num_key_value_heads=4, head_dim=64, vocab_size=151936,
            max_position_embeddings=40960, rope_theta=1_000_000.0, tie_word_embeddings=True,
        ),
    ),
    # Layers 0-2 are gated-delta-net (linear attention), layer 3 full attention, as in real Qwen3.5.
    "qwen3_5-tiny": ModelSpec(
        vocab="qwen3_5",
        config=dict(
            model_type="qwen3_5", hidden_size=64, intermediate_size=192, num_hidden_layers=4,
            full_attention_interval=4, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
            linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=32,
            linear_value_head_dim=32, linear_conv_kernel_dim=4, vocab_size=248320,
            max_position_embeddings=4096, rope_parameters=_QWEN3_5_ROPE, tie_word_embeddings=True,
        ),
    ),
    # Qwen3.5 of realistic proportions for benchmarks: six gated-delta-net layers (8 key and
    # 8 value heads of 128, as Qwen3.5-0.8B has 16) and two full-attention layers, hidden 512.
    "qwen3_5-small": ModelSpec(
        vocab="qwen3_5",
        config=dict(
            model_type="qwen3_5", hidden_size=512, intermediate_size=1536, num_hidden_layers=8,
            full_attention_interval=4, num_attention_heads=8, num_key_value_heads=2,
            head_dim=128, linear_num_key_heads=8, linear_num_value_heads=8,
            linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4,
            vocab_size=248320, max_position_embeddings=8192, rope_parameters=_QWEN3_5_ROPE,
            tie_word_embeddings=True,
        ),
    ),
    # Gemma 3: sliding-window layers (a RotatingKVCache of the last 32 positions) between
    # full-attention layers, so prompts a few windows long exercise both kinds.
    "gemma3-tiny": ModelSpec(
        vocab="qwen3",
        config=dict(
            model_type="gemma3_text", hidden_size=64, intermediate_size=192, num_hidden_layers=4,
            sliding_window=32, sliding_window_pattern=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=32, query_pre_attn_scalar=32, vocab_size=151936,
            max_position_embeddings=4096, rope_theta=1_000_000.0, rope_local_base_freq=10_000.0,
            tie_word_embeddings=True,
        ),
    ),
}  # fmt: skip

# qwen3-tiny and qwen3-small whose replies end by themselves (the end-of-turn token likely
# after a few tokens): what the coding agents' tests and benchmark drive, whose clients wait
# for a reply to end (a reply cut at a token cap is an error to both agent CLIs).
for _name in ("qwen3-tiny", "qwen3-small"):
    BUILTINS[_name.replace("qwen3-", "qwen3-chat-")] = replace(BUILTINS[_name], end_gain=4.0,
                                                               weights_of=_name)

# The family test matrix (tests/runner/test_families.py): one tiny model per architecture family,
# from mlx-lm's own classes, each through every runner-core oracle mode. Hidden 64, 2-4 layers,
# the Qwen 3 tokenizer; tied or untied as the family usually is. Not in BUILTINS (the names a
# config may serve: protocol/config.py BUILTIN_NAME, pinned in tests/runner/test_builtin_model.py);
# ensure_builtin builds them all the same.
_MINISTRAL3_ROPE = {"rope_type": "default", "rope_theta": 1_000_000.0,
                    # Llama 4's query scaling: 1 + beta * log(1 + floor(pos / 32)), so prompts
                    # of a few dozen tokens cross its steps (real models: 16384 positions).
                    "llama_4_scaling_beta": 0.1, "original_max_position_embeddings": 32}

FAMILIES: dict[str, ModelSpec] = {
    "llama-tiny": ModelSpec(
        vocab="qwen3",
        config=dict(
            model_type="llama", hidden_size=64, intermediate_size=192, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, vocab_size=151936,
            max_position_embeddings=4096, rope_theta=500_000.0, tie_word_embeddings=True,
        ),
    ),
    # Biased q/k/v projections, no q/k norms.
    "qwen2-tiny": ModelSpec(
        vocab="qwen3",
        config=dict(
            model_type="qwen2", hidden_size=64, intermediate_size=192, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, vocab_size=151936,
            max_position_embeddings=4096, rope_theta=1_000_000.0, tie_word_embeddings=True,
        ),
    ),
    # Every layer a sparse MoE: 4 experts, 2 per token (mlx-lm's SwitchGLU).
    "qwen3_moe-tiny": ModelSpec(
        vocab="qwen3",
        config=dict(
            model_type="qwen3_moe", hidden_size=64, intermediate_size=192, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_experts=4,
            num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[],
            moe_intermediate_size=64, norm_topk_prob=True, vocab_size=151936,
            max_position_embeddings=4096, rope_theta=1_000_000.0, tie_word_embeddings=False,
        ),
    ),
    # Fused qkv_proj and gate_up_proj, an untied head.
    "phi3-tiny": ModelSpec(
        vocab="qwen3",
        config=dict(
            model_type="phi3", hidden_size=64, intermediate_size=192, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, vocab_size=151936,
            max_position_embeddings=4096, original_max_position_embeddings=4096,
            rope_theta=10_000.0, tie_word_embeddings=False,
        ),
    ),
    # Sliding-window (32) and full layers in turn, attention sinks, biased projections, a MoE
    # of 4 experts (2 per token) with SwiGLU-OAI, an untied head.
    "gpt_oss-tiny": ModelSpec(
        vocab="qwen3",
        config=dict(
            model_type="gpt_oss", hidden_size=64, intermediate_size=64, num_hidden_layers=4,
            layer_types=["sliding_attention", "full_attention"] * 2, sliding_window=32,
            num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_local_experts=4,
            num_experts_per_tok=2, vocab_size=151936, max_position_embeddings=4096,
            rope_theta=150_000, tie_word_embeddings=False,
        ),
    ),
    # Ministral 3 (Mistral's 2025 dense family): Llama-like, with Llama 4's position-dependent
    # query scaling.
    "ministral3-tiny": ModelSpec(
        vocab="qwen3",
        config=dict(
            model_type="ministral3", hidden_size=64, intermediate_size=192, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=32, vocab_size=151936,
            max_position_embeddings=4096, rope_parameters=_MINISTRAL3_ROPE,
            tie_word_embeddings=True,
        ),
    ),
    # Multi-head latent attention (the cache keeps the kv_a latent and the RoPE key), a dense
    # first layer, then a MoE of 4 routed experts (2 per token, sigmoid scores) and a shared one.
    "deepseek_v3-tiny": ModelSpec(
        vocab="qwen3",
        config=dict(
            model_type="deepseek_v3", hidden_size=64, intermediate_size=192,
            moe_intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=4, n_shared_experts=1, n_routed_experts=4,
            num_experts_per_tok=2, first_k_dense_replace=1, moe_layer_freq=1, n_group=1,
            topk_group=1, routed_scaling_factor=2.5, q_lora_rank=48, kv_lora_rank=32,
            qk_rope_head_dim=16, qk_nope_head_dim=32, v_head_dim=32, vocab_size=151936,
            max_position_embeddings=4096, rope_theta=10_000.0, tie_word_embeddings=False,
        ),
    ),
    # DeepSeek-V3.2's sparse attention: V3's latent attention plus a lightning indexer that
    # picks the top index_topk keys per query (16 here, so prompts past it are sparse); each
    # layer's cache is a CacheList of two KV caches (the latent, the indexer's keys).
    "deepseek_v32-tiny": ModelSpec(
        vocab="qwen3",
        config=dict(
            model_type="deepseek_v32", hidden_size=64, intermediate_size=192,
            moe_intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=4, n_shared_experts=1, n_routed_experts=4,
            num_experts_per_tok=2, first_k_dense_replace=1, moe_layer_freq=1, n_group=1,
            topk_group=1, routed_scaling_factor=2.5, q_lora_rank=48, kv_lora_rank=32,
            qk_rope_head_dim=16, qk_nope_head_dim=32, v_head_dim=32, index_n_heads=2,
            index_head_dim=32, index_topk=16, vocab_size=151936,
            max_position_embeddings=4096, rope_theta=10_000.0, tie_word_embeddings=False,
        ),
    ),
}  # fmt: skip


def _spec(name: str) -> ModelSpec | None:
    return BUILTINS.get(name) or FAMILIES.get(name)


def default_cache_dir() -> Path:
    return Path(os.environ.get("MAS_CACHE_DIR") or Path.home() / ".cache" / "mlx-actor-serve" / "models")


_LATER = {"end_gain": 1.0, "weights_of": ""}


def spec_hash(spec: ModelSpec) -> str:
    # Fields added later are left out at their defaults: the hashes stay as before them.
    fields = {k: v for k, v in asdict(spec).items() if _LATER.get(k, object()) != v}
    blob = json.dumps({"build": BUILD_VERSION, **fields}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:10]


def ensure_builtin(name: str, cache_dir: Path | None = None, progress: bool = True) -> Path:
    """The directory of built-in `name`, building it first if this spec was never built here.
    A format variant (`qwen3-tiny-4bit`, `qwen3_5-tiny-bf16`, ...: models/formats.py) is the
    built-in converted by mlx-lm, cached the same way."""
    spec = _spec(name)
    if spec is None:
        if (parsed := parse_variant(name)) is not None:
            return _ensure_variant(name, *parsed, cache_dir, progress)
        raise KeyError(f"unknown built-in model {name!r}; known: {sorted(BUILTINS)}, "
                       f"and their variants {formats.GRAMMAR}; families: {sorted(FAMILIES)}")
    cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    final = cache_dir / f"{name}-{spec_hash(spec)}"
    return build_once(final, lambda scratch: build_model_dir(name, spec, scratch, progress))



def parse_variant(name: str) -> tuple[str, formats.Format] | None:
    """(base, format) of a format variant of a built-in (models/formats.py); None if not one."""
    return formats.parse(name, BUILTINS)


def _ensure_variant(name: str, base: str, fmt: formats.Format, cache_dir: Path | None,
                    progress: bool) -> Path:
    """The directory of variant `name`, converting its built-in (built first if need be) once."""
    base_hash = spec_hash(BUILTINS[base])
    cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    final = cache_dir / f"{name}-{formats.variant_hash(base_hash)}"
    if final.is_dir():  # the launcher finds a cached variant without importing MLX
        return final
    formats.check_groups(name, fmt, weight_shapes(model_config(base, BUILTINS[base])))
    source = ensure_builtin(base, cache_dir, progress)
    config = {"builtin": name, "base": base, "spec_hash": base_hash, "format": asdict(fmt)}
    return build_once(final, lambda scratch: formats.convert(source, scratch, fmt, config, progress))


def build_once(final: Path, build: Callable[[Path], None]) -> Path:
    """`final`, made by build(scratch) unless it is there already; `scratch` does not exist yet."""
    if final.is_dir():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    # Build beside the final path and rename: a directory under the final name is always complete,
    # and of two concurrent builders the second rename fails and that builder uses the first's result.
    scratch = final.parent / f".{final.name}.building-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        build(scratch)
        try:
            scratch.rename(final)
        except OSError:
            if not final.is_dir():
                raise
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return final


_ARCHITECTURES = {
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_5": "Qwen3_5ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "gpt_oss": "GptOssForCausalLM",
    "ministral3": "Ministral3ForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
    "deepseek_v32": "DeepseekV32ForCausalLM",
}

_ACTIVATIONS = {"gemma3_text": {"hidden_activation": "gelu_pytorch_tanh"}}  # as Gemma 3 configs say


def model_config(name: str, spec: ModelSpec) -> dict:
    """config.json: the spec's architecture plus the fields loaders expect from a real checkpoint."""
    specials = VOCABS[spec.vocab].special_ids()
    arch = copy.deepcopy(spec.config)
    config = {
        "architectures": [_ARCHITECTURES[arch["model_type"]]],
        **arch,
        **_ACTIVATIONS.get(arch["model_type"], {"hidden_act": "silu"}),
        "rms_norm_eps": 1e-6,
        "attention_bias": False,
        "bos_token_id": specials["<|endoftext|>"],
        "eos_token_id": [specials["<|im_end|>"], specials["<|endoftext|>"]],
        "pad_token_id": specials["<|endoftext|>"],
        "torch_dtype": "float32",
        "dtype": "float32",
        "mlx_actor_serve": {"builtin": name, "spec_hash": spec_hash(spec)},
    }
    if arch["model_type"] == "qwen3_5":
        # Informational, as in real Qwen3.5 configs; mlx-lm derives the pattern from the interval.
        interval = arch["full_attention_interval"]
        config["layer_types"] = [
            "full_attention" if (i + 1) % interval == 0 else "linear_attention"
            for i in range(arch["num_hidden_layers"])
        ]
    if arch["model_type"] == "gemma3_text":
        # Informational too: mlx-lm derives the pattern from sliding_window_pattern.
        pattern = arch["sliding_window_pattern"]
        config["layer_types"] = [
            "full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
            for i in range(arch["num_hidden_layers"])
        ]
    return config


def weight_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """Parameter names and shapes, taken from mlx-lm's own model class so loading matches exactly."""
    # MLX only to build: the launcher finds a cached built-in without loading it.
    from mlx.utils import tree_flatten

    arch = importlib.import_module(f"mlx_lm.models.{config['model_type']}")
    # A copy, because mlx-lm's argument classes rewrite nested dicts (rope_parameters) in place.
    model = arch.Model(arch.ModelArgs.from_dict(copy.deepcopy(config)))  # lazy: nothing is computed
    shapes = {path: tuple(value.shape) for path, value in tree_flatten(model.parameters())}
    if config.get("tie_word_embeddings"):
        # Gemma builds an lm_head and drops it at load when the checkpoint has none (tied).
        shapes.pop("lm_head.weight", None)
    return shapes


def count_params(name: str) -> int:
    spec = _spec(name)
    return sum(int(np.prod(s)) for s in weight_shapes(model_config(name, spec)).values())


def _seed(text: str) -> int:
    # Python's hash() is salted per process; a digest gives every machine and run the same seed.
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little")


_NORM_OFFSET = {"gemma3_text": 1.0}


def init_weight(path: str, shape: tuple[int, ...], spec: ModelSpec, seed: int) -> np.ndarray:
    """One parameter's initial value; each has its own stream so the order of generation is irrelevant."""
    rng = np.random.default_rng([seed, _seed(path)])
    leaf = path.rsplit(".", 2)[-2]  # e.g. "q_proj" of "...self_attn.q_proj.weight"
    # Gemma's RMSNorm scales by 1 + weight: store the scale minus one, so it scales the same.
    offset = _NORM_OFFSET.get(spec.config["model_type"], 0.0)
    if path.endswith("model.norm.weight"):
        scale = spec.logit_std / (spec.embed_std * np.sqrt(shape[0]))
        return np.full(shape, scale - offset, np.float32)
    if leaf in ("q_norm", "k_norm"):
        return np.full(shape, spec.qk_norm - offset, np.float32)
    if path.endswith("norm.weight"):
        return np.full(shape, 1.0 - offset, np.float32)
    if leaf == "embed_tokens":
        table = spec.embed_std * rng.standard_normal(shape, np.float32)
        table[VOCABS[spec.vocab].special_ids()["<|im_end|>"]] *= spec.end_gain
        return table
    if path.endswith("A_log"):  # gated-delta decay rates: log(U[1, 16]), the range real models use
        return np.log(rng.uniform(1.0, 16.0, shape)).astype(np.float32)
    if path.endswith("dt_bias"):
        return np.ones(shape, np.float32)
    # The rules below only match the families' parameters (FAMILIES); the built-ins have none.
    if leaf == "lm_head":  # an untied head: logits spread as a tied one's (logit_std)
        return spec.embed_std * rng.standard_normal(shape, np.float32)
    if path.endswith("e_score_correction_bias"):  # DeepSeek's router balance: none yet
        return np.zeros(shape, np.float32)
    if path.endswith(".bias"):  # q/k/v (Qwen 2), every projection and expert (gpt-oss)
        return 0.1 * rng.standard_normal(shape, np.float32)
    if path.endswith(".sinks"):  # gpt-oss attention sinks: a logit per head, about the scores'
        return rng.standard_normal(shape, np.float32)
    if ".switch_mlp." in path or ".experts." in path or leaf in ("embed_q", "unembed_out"):
        # Stacked experts [experts, out, in] and MLA's per-head products [heads, out, in]:
        # each is a stack of matrices with the last axis their input.
        gain = spec.residual_gain if leaf == "down_proj" else 1.0
        return (gain / np.sqrt(shape[-1])) * rng.standard_normal(shape, np.float32)
    fan_in = shape[1] if len(shape) == 2 else int(np.prod(shape[1:]))
    gain = spec.residual_gain if leaf in ("o_proj", "down_proj", "out_proj") else 1.0
    return (gain / np.sqrt(fan_in)) * rng.standard_normal(shape, np.float32)


def build_model_dir(name: str, spec: ModelSpec, directory: Path, progress: bool = True) -> None:
    """Write config.json, model.safetensors and the tokenizer files of `spec` into `directory`."""
    import mlx.core as mx

    directory.mkdir(parents=True)
    config = model_config(name, spec)
    shapes = weight_shapes(config)
    seed = _seed(spec.weights_of or name)
    total = sum(int(np.prod(s)) for s in shapes.values()) * 4
    weights = {}
    with tqdm(total=total, unit="B", unit_scale=True, desc=f"building {name}", file=sys.stderr,
              disable=not progress) as bar:  # fmt: skip
        for path in sorted(shapes):
            weights[path] = mx.array(init_weight(path, shapes[path], spec, seed))
            bar.update(weights[path].nbytes)
        bar.set_postfix_str("writing")
        mx.save_safetensors(str(directory / "model.safetensors"), weights, metadata={"format": "mlx"})
        bar.set_postfix_str("tokenizer")
        write_tokenizer(directory, spec.vocab)
    (directory / "config.json").write_text(json.dumps(config, indent=2))
