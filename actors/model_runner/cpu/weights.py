"""Weights kept as stored (4-bit, 8-bit, bf16, ...) and multiplied fast on the CPU
(docs/architecture.md, section 10).

On x86 CPUs MLX's `quantized_matmul` and its bf16 matmul are scalar code, 5-60x slower than a
float32 product through MKL, while decode is bound by the bytes of weights read (a 4-bit weight
is 1/7 of the float32 bytes). Each weight kind (the format of a linear layer's weight, or of a
tied LM head) gets one strategy, chosen at launch and logged (`runner.weights`):

- "float32": MLX's own matmul through the BLAS; nothing changes.
- "kernel": our compiled kernels (native/, module `mas_kernels`): affine 4 and 8 bits with
  groups of 32, 64 or 128, and bf16. They are MLX primitives, so they stay in the lazy graph.
- "jit": products of few rows through MLX's own kernel; products of more rows dequantize (or
  upcast) the weight to float32 just in time and go through the BLAS. "More" is where the
  dequantization costs less than MLX's kernel on the extra rows (JIT_ROWS): two rows for
  bf16/fp16 and mxfp8, up to 32 for 6-bit, whose dequantization MLX does slowly.
- "resident": upcast once to float32 at load (within `runtime.weight_memory_budget_mib`). In a
  model with float32 activations the layer then is a plain float32 layer and takes every
  float32 path; in a bf16/fp16 model its products come back in the model's dtype, as the
  stored layer's did (a float32 output would carry the rest of the model into float32).
- "mlx": MLX's own ops for everything (`runtime.weights = "mlx"`, or not on the CPU).

`runtime.weights = "auto"` takes "kernel" where the kernels cover the kind and are built, else
"jit" (every other format: 2, 3, 5, 6 bits, mxfp4, nvfp4, mxfp8, fp16); without the compiled
kernels (no compiler at install) the launch log says what is missing and the runner serves
through "jit".
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import mlx.nn as nn

KERNEL_BITS = (4, 8)
KERNEL_GROUPS = (32, 64, 128)


def load_kernels() -> tuple[Any, str]:
    """The compiled kernels module, or None and why not."""
    try:
        import mas_kernels
    except ImportError as e:
        return None, (f"the compiled CPU kernels (package mas_kernels, built from native/ by "
                      f"`make setup`) are not installed: {e}")
    return mas_kernels, ""


def kind_of(module: nn.Module) -> str:
    """The format of a linear or tied-head weight: "affine-4bit-g64", "mxfp4-4bit-g32",
    "bfloat16", "float32", ..."""
    if isinstance(module, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
        return f"{module.mode}-{module.bits}bit-g{module.group_size}"
    return str(module.weight.dtype).removeprefix("mlx.core.")


def _kernel_covers(module: nn.Module) -> bool:
    if isinstance(module, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
        k = module.weight.shape[-1] * 32 // module.bits
        return (module.mode == "affine" and module.bits in KERNEL_BITS
                and module.group_size in KERNEL_GROUPS and k % module.group_size == 0)
    return module.weight.dtype == mx.bfloat16


# -- products -----------------------------------------------------------------------------


def _rows(x: mx.array) -> int:
    return x.size // x.shape[-1] if x.ndim else 0


def _in_f32(x: mx.array, product) -> mx.array:
    """The kernels take float32 activations; a bf16/fp16 model's come back in its dtype."""
    if x.dtype == mx.float32:
        return product(x)
    return product(x.astype(mx.float32)).astype(x.dtype)


def _dequantized(module: nn.Module) -> mx.array:
    """The weight in float32. (MLX's default for the floating-point modes is bfloat16: exact
    for their values, but a float16 model would round it again.)"""
    return mx.dequantize(module.weight, module.scales, module.get("biases"),
                         group_size=module.group_size, bits=module.bits, mode=module.mode,
                         dtype=mx.float32)


# From how many rows "jit" dequantizes, per (mode, bits): where mx.dequantize plus the
# float32 BLAS product costs less than mx.quantized_matmul, which costs about the same per row
# for every format (2-4 ms per row on a 3072x1024 weight; mxfp8 9) while dequantization differs
# 10x (measured on this project's 2-core x86 machine with MKL: 2 and 4 bits 8-13 ms, 8 bits 25,
# 3, 5 and 6 bits 60-95, mxfp4 and nvfp4 40, mxfp8 11). Kinds not listed dequantize from 2.
JIT_ROWS = {("affine", 2): 6, ("affine", 3): 16, ("affine", 4): 4, ("affine", 5): 24,
            ("affine", 6): 32, ("affine", 8): 8, ("mxfp4", 4): 16, ("nvfp4", 4): 16,
            ("mxfp8", 8): 2}


# The kernels module once install() found it: products run per layer per step, so no import
# lookup there.
_kernels: Any = None


def _quantized_product(module: nn.Module, x: mx.array, strategy: str) -> mx.array:
    if strategy == "kernel":
        return _in_f32(x, lambda a: _kernels.affine_qmm(
            a, module.weight, module.scales, module["biases"], module.group_size, module.bits))
    if strategy == "jit" and _rows(x) >= JIT_ROWS.get((module.mode, module.bits), 2):
        return _in_f32(x, lambda a: a @ _dequantized(module).T)
    return mx.quantized_matmul(x, module.weight, scales=module.scales,
                               biases=module.get("biases"), transpose=True,
                               group_size=module.group_size, bits=module.bits, mode=module.mode)


def _dense_product(module: nn.Module, x: mx.array, strategy: str) -> mx.array:
    if strategy == "kernel":
        return _in_f32(x, lambda a: _kernels.bf16_matmul(a, module.weight))
    if strategy == "resident":  # the weight is float32 already
        return _in_f32(x, lambda a: a @ module.weight.T)
    if strategy == "jit" and _rows(x) > 1:
        # MLX's bf16/fp16 matmul is scalar code on x86: the upcast and the BLAS cost less from
        # two rows on (measured 3072x1024: 1.1-10x less for 2-128 rows); for one row MLX's
        # own reads half the bytes and wins on large weights (the tied LM head).
        return _in_f32(x, lambda a: a @ module.weight.astype(mx.float32).T)
    return x @ module.weight.T


def _kernel_triple(module: nn.Module) -> tuple[mx.array, mx.array, mx.array] | None:
    """A quantized layer's (weight, scales, biases) where our kernel multiplies it, else None."""
    # Exactly the layer's own product: a subclass with a __call__ of its own (an LM head's
    # last-position cut) is left to it.
    if isinstance(module, StoredQuantizedLinear) and module.strategy == "kernel" \
            and type(module).__call__ is StoredQuantizedLinear.__call__ and "bias" not in module:
        return module.weight, module.scales, module["biases"]
    return None


def _shared_format(x: mx.array, modules: list[nn.Module]) -> list | None:
    triples = [_kernel_triple(m) for m in modules]
    if (x.dtype != mx.float32 or any(t is None for t in triples)
            or len({(m.group_size, m.bits) for m in modules}) != 1):
        return None
    return [a for t in triples for a in t]


def layer_products(x: mx.array, modules: list[nn.Module]) -> tuple[Any, list, int, int] | None:
    """(the kernels module, the modules' (weight, scales, biases) flat, group size, bits) where
    our kernel multiplies every one of them in one format (a fused layer's products); else
    None."""
    arrays = _shared_format(x, modules)
    return None if arrays is None else (_kernels, arrays, modules[0].group_size, modules[0].bits)


def shared_products(x: mx.array, modules: list[nn.Module]) -> list[mx.array] | None:
    """[m(x) for m in modules] as one graph node (mas_kernels.affine_qmm_many: each product
    affine_qmm's values) where our kernel multiplies them all in one format; else None."""
    arrays = _shared_format(x, modules)
    if arrays is None:
        return None
    return list(_kernels.affine_qmm_many(x, arrays, modules[0].group_size, modules[0].bits))


def swiglu_product(x: mx.array, gate: nn.Module, up: nn.Module) -> mx.array | None:
    """silu(gate(x)) * up(x) as one graph node (mas_kernels.affine_swiglu: the two products'
    and the SiLU kernel's values) where our kernel multiplies both in one format; else None.
    The caller checks that its SwiGLU would take the SiLU kernel."""
    arrays = _shared_format(x, [gate, up])
    if arrays is None:
        return None
    return _kernels.affine_swiglu(x, *arrays, gate.group_size, gate.bits)


class _Stored:
    """Mixin of a layer multiplied by its kind's strategy (set per class, see _class_for)."""

    strategy = "mlx"
    # A resident layer of a bf16/fp16 model: the model's dtype, which the lookups of its
    # float32 embedding come back in (its products come back in the input's dtype).
    model_dtype: mx.Dtype | None = None


class StoredQuantizedLinear(_Stored, nn.QuantizedLinear):
    def __call__(self, x: mx.array) -> mx.array:
        out = _quantized_product(self, x, self.strategy)
        return out + self["bias"] if "bias" in self else out


class StoredQuantizedEmbedding(_Stored, nn.QuantizedEmbedding):
    def __call__(self, x: mx.array) -> mx.array:
        looked_up = self._kernel_lookup(x)
        if looked_up is not None:
            return looked_up
        if self.model_dtype is None:
            return super().__call__(x)
        # The rows' scales in the model's dtype first: mx.dequantize computes in the scales'
        # dtype, so bf16 scales would round the rows to bf16.
        shape, x = x.shape, x.flatten()
        biases = self.get("biases")
        out = mx.dequantize(self.weight[x], self.scales[x].astype(self.model_dtype),
                            None if biases is None else biases[x].astype(self.model_dtype),
                            group_size=self.group_size, bits=self.bits, mode=self.mode)
        return out.reshape(*shape, -1)

    def as_linear(self, x: mx.array) -> mx.array:
        return _quantized_product(self, x, self.strategy)

    def _kernel_lookup(self, x: mx.array) -> mx.array | None:
        """The rows as one graph node (mas_kernels.quantized_rows), mx.dequantize's values bit
        for bit, where the kernels take the layout; else None. MLX's own lookup is ~60 nodes
        on the CPU (a shift pair per packed value, a concatenation, casts, gathers), most of
        a 4-bit decode step's ~340 before the few-node layers (qwen3_layers.py)."""
        # The kernel strategy is affine 4/8-bit (_kernel_covers); model_dtype is None (the
        # scales' type) or float32 (float32 lookups).
        if (self.strategy != "kernel" or "biases" not in self
                or self.scales.dtype not in (mx.float32, mx.bfloat16)):
            return None
        float32 = self.model_dtype is not None and self.model_dtype == mx.float32
        ids = x.flatten()
        ids = ids if ids.dtype == mx.int32 else ids.astype(mx.int32)
        out = _kernels.quantized_rows(self.weight, self.scales, self["biases"], ids,
                                      self.group_size, self.bits, float32)
        return out.reshape(*x.shape, out.shape[-1])


class StoredLinear(_Stored, nn.Linear):
    def __call__(self, x: mx.array) -> mx.array:
        out = _dense_product(self, x, self.strategy)
        return out + self["bias"] if "bias" in self else out


class StoredEmbedding(_Stored, nn.Embedding):
    def __call__(self, x: mx.array) -> mx.array:
        out = super().__call__(x)
        return out if self.model_dtype is None else out.astype(self.model_dtype)

    def as_linear(self, x: mx.array) -> mx.array:
        return _dense_product(self, x, self.strategy)


_BASES = {nn.QuantizedLinear: StoredQuantizedLinear,
          nn.QuantizedEmbedding: StoredQuantizedEmbedding,
          nn.Linear: StoredLinear, nn.Embedding: StoredEmbedding}
_classes: dict[tuple[type, str, mx.Dtype | None], type] = {}


def _class_for(cls: type, strategy: str, model_dtype: mx.Dtype | None = None) -> type:
    """One subclass per (layer class, strategy, model dtype), so these are class attributes
    and the module keeps only its arrays."""
    key = (cls, strategy, model_dtype)
    if key not in _classes:
        base = _BASES[cls]
        _classes[key] = type(f"{base.__name__}{strategy.title()}", (base,),
                             {"strategy": strategy, "model_dtype": model_dtype})
    return _classes[key]


# -- the plan -------------------------------------------------------------------------------


@dataclass
class KindPlan:
    strategy: str
    layers: int = 0
    stored_bytes: int = 0  # the weights as stored (with scales and biases)
    resident_bytes: int = 0  # float32 copies kept besides ("resident")


@dataclass
class WeightPlan:
    kinds: dict[str, KindPlan] = field(default_factory=dict)
    kernels: str = ""  # the kernels' instruction set in use, or "" when not used
    missing: str = ""  # why the kernels are not used, when "auto" wanted them
    activations: str = "model"  # runtime.activations as applied

    def log_fields(self) -> dict[str, Any]:
        return {"strategies": {k: p.strategy for k, p in self.kinds.items()},
                "layers": {k: p.layers for k, p in self.kinds.items()},
                "stored_mib": round(sum(p.stored_bytes for p in self.kinds.values()) / 2**20, 1),
                "resident_mib": round(sum(p.resident_bytes for p in self.kinds.values()) / 2**20,
                                      1),
                "kernels": self.kernels or "off", "missing": self.missing,
                "activations": self.activations}


def _matmul_modules(model: nn.Module) -> list[nn.Module]:
    """Linear layers, and embeddings (their as_linear is the tied LM head)."""
    return [m for _, m in model.named_modules()
            if type(m) in _BASES or isinstance(m, _Stored)]


def _stored_bytes(module: nn.Module) -> int:
    return sum(a.nbytes for name, a in module.items() if isinstance(a, mx.array)
               and name in ("weight", "scales", "biases"))


def _float32_bytes(module: nn.Module) -> int:
    """The bytes of the weight upcast to float32 (a packed uint32 holds 32 / bits values:
    10 and a fraction for 3 bits, so multiply before dividing)."""
    if isinstance(module, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
        return module.weight.size * 32 // module.bits * 4
    return module.weight.size * 4


def _strategy(module: nn.Module, wanted: str, kernels: Any) -> str:
    if kind_of(module) == "float32":
        return "float32"
    if wanted == "auto":
        return "kernel" if kernels is not None and _kernel_covers(module) else "jit"
    return wanted


def loaded_kernels() -> Any:
    """The compiled kernels module if an install() loaded it, else None."""
    return _kernels


def compiled_kernels(runtime: Any) -> Any:
    """The compiled kernels for the other float32 paths (skinny.py's few-row products,
    attention.py's decode attention): the module install() found under "auto", else None."""
    return _kernels if runtime.weights == "auto" and mx.default_device() == mx.cpu else None


def _budget(runtime: Any) -> int:
    if runtime.weight_memory_budget_mib:
        return runtime.weight_memory_budget_mib << 20
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2


def _model_dtype(model: nn.Module) -> mx.Dtype:
    """The dtype of the model's activations: that of most floating parameters outside its
    matmul layers (the norms). float32 when there are none."""
    counts: dict[mx.Dtype, int] = {}
    for _, module in model.named_modules():
        if type(module) in _BASES or isinstance(module, _Stored):
            continue
        for value in module.values():
            if isinstance(value, mx.array) and mx.issubdtype(value.dtype, mx.floating):
                counts[value.dtype] = counts.get(value.dtype, 0) + 1
    return max(counts, key=counts.get) if counts else mx.float32


def _float32_activations(model: nn.Module) -> None:
    """Every floating parameter outside the matmul layers (norms, gates, decay rates) to
    float32: the activations, and so the KV cache, follow them. The matmul layers keep their
    stored weights; their embedding lookups come back in float32 (class attribute above)."""
    for _, module in model.named_modules():
        if type(module) in _BASES or isinstance(module, _Stored):
            continue
        wide = {k: v.astype(mx.float32) for k, v in module.items()
                if isinstance(v, mx.array) and mx.issubdtype(v.dtype, mx.floating)
                and v.dtype != mx.float32}
        if wide:
            module.update(wide)


def _make_resident(module: nn.Module, model_dtype: mx.Dtype) -> None:
    """Replace the stored weight by its float32 upcast: the layer becomes a float32 one, whose
    products come back in `model_dtype` when that is not float32."""
    quantized = isinstance(module, (nn.QuantizedLinear, nn.QuantizedEmbedding))
    module.weight = _dequantized(module) if quantized else module.weight.astype(mx.float32)
    mx.eval(module.weight)
    for name in ("scales", "biases"):
        if name in module:
            del module[name]
    embedding = isinstance(module, (nn.Embedding, nn.QuantizedEmbedding))
    plain = nn.Embedding if embedding else nn.Linear
    module.__class__ = (plain if model_dtype == mx.float32
                        else _class_for(plain, "resident", model_dtype))


def install(model: nn.Module, runtime: Any) -> WeightPlan:
    """Choose each weight kind's strategy and switch the layers to it, in place. ValueError
    (naming the key) when resident float32 copies would not fit the memory budget."""
    plan = WeightPlan()
    wanted = runtime.weights if mx.default_device() == mx.cpu else "mlx"
    kernels = None
    if wanted == "auto":
        kernels, plan.missing = load_kernels()
        plan.kernels = kernels.isa() if kernels is not None else ""
        global _kernels
        _kernels = kernels if kernels is not None else _kernels
    modules = _matmul_modules(model)
    chosen = [(m, kind_of(m), _strategy(m, wanted, kernels)) for m in modules]
    resident = sum(_float32_bytes(m) for m, _, s in chosen if s == "resident")
    float32 = runtime.activations == "float32"
    model_dtype = _model_dtype(model) if resident and not float32 else mx.float32
    if resident > _budget(runtime):
        raise ValueError(f"runtime.weights = \"resident\" needs {resident / 2**20:.0f} MiB of "
                         f"float32 weights; runtime.weight_memory_budget_mib allows "
                         f"{_budget(runtime) / 2**20:.0f} MiB")
    for module, kind, strategy in chosen:
        entry = plan.kinds.setdefault(kind, KindPlan(strategy))
        entry.layers += 1
        entry.stored_bytes += _stored_bytes(module)
        if float32 and strategy != "kernel" and "scales" in module:
            # MLX's quantized_matmul and dequantize compute in the scales' dtype: float32
            # scales (exact for bf16/fp16 ones) keep them in float32, as the upcast checkpoint
            # does. The kernels read bf16/fp16 scales as they are.
            module.update({k: module[k].astype(mx.float32) for k in ("scales", "biases")
                           if k in module and module[k] is not None})
        if strategy == "resident":
            _make_resident(module, model_dtype)
            entry.resident_bytes += module.weight.nbytes
        elif strategy != "float32":
            base = next(b for b in _BASES if isinstance(module, b))
            lookups = float32 and base in (nn.Embedding, nn.QuantizedEmbedding)
            module.__class__ = _class_for(base, strategy, mx.float32 if lookups else None)
    if float32:
        _float32_activations(model)
        plan.activations = "float32"
    if not any(p.strategy == "kernel" for p in plan.kinds.values()):
        plan.kernels = ""
    if not any(_kernel_covers(m) for m, kind, _ in chosen if kind != "float32"):
        plan.missing = ""  # nothing here the kernels would have taken
    return plan
