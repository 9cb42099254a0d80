"""Greedy rows' next tokens without the vocabulary-wide LM head product.

In decode the LM head of a small model with a large vocabulary is most of a step: on
qwen3-small (151,936 x 512 float32, tied) it reads 311 MB per step and, at 16 rows, is more
arithmetic than the six layers together; a greedy row then keeps one number of its 151,936.
`mas_kernels.greedy_head` finds that number from an int8 copy of the head with error bounds,
and multiplies exactly only the rows that can still win (native/src/greedy_head.cpp): the
token is the argmax of the exact logits, as mx.argmax gives (up to ties within float
rounding, like any change of batch or BLAS).

This module owns the int8 copy (prepared once at load: one byte per weight, 78 MB on
qwen3-small beside the 311 MB of float32) and the switch in the head modules: inside
`capture()`, the head modules (head.py) record their input and return a placeholder that is
never evaluated, and the runner asks `GreedyHead.tokens` instead; `capture(replace=False)`
only records the input (the runner keeps it with a hybrid model's snapshots) and the head
runs. Float32 and bfloat16 head weights qualify, with float32 logits or a bf16 model's bf16
ones (the float32 sums rounded to bf16, where equal logits are common: the bounds cover that
rounding and the exact products are rounded alike, so the lowest of the equal indices wins as
in mx.argmax).

4-bit and 8-bit heads (mlx's affine layout) qualify too where the kernel has its vectorized
path (`qhead_fast`: AVX-512 VNNI or AVX2): there the screening reads the model's own codes, so
nothing is copied and W carries no error of its own, only x's quantization; what is prepared
is a float32 table of the scales and biases in 16-row blocks (the kernel applies a group's to
16 rows at once) and per-row norms; on AVX2 also the table in float16, which the screening
reads instead (prepare_quantized). At 16 rows it is integer arithmetic where the quantized
head's product is float32 FMAs on decoded weights. Up to 12 rows the kernel reads the codes as
they lie (no transposed block), integer products in lanes along K. qwen3-small's head, the
screening vs the float product and its argmax, ms (`python -m benchmarks.kernels.greedy_head
--rows 1 2 4 8 12 16`, AMD EPYC, AVX-512): 4-bit 1.9 / 3.0 at 1 row, 2.0 / 3.7 at 2, 3.1 / 5.3
at 4, 4.7 / 12.1 at 8, 6.7 / 16.0 at 12, 7.6 / 16.6 at 16; 8-bit 2.7 / 4.7, 3.4 / 4.4, 4.1 /
6.3, 5.2 / 12.6, 7.3 / 15.3, 9.6 / 18.5. On AVX2 (AMD EPYC with AVX-512 hidden): 4-bit 1.5 /
5.6 at 1 row, 3.7 / 7.4 at 4, 12.4 / 32.7 at 16; 8-bit 2.9 / 6.0, 3.9 / 7.7, 15.6 / 34.2. So
the greedy head stands in at every batch size, as a float32 head's int8 screening (a quarter
of its bytes) does.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from actors.model_runner.thread_flag import ThreadFlag

_CHUNK = 8192  # rows of the head prepared at once (numpy temporaries stay ~100 MB)
_K_ALIGN = 64  # the kernels read x and w in 64-byte steps
_N_ALIGN = 16  # and the stats in tiles of 16 rows


class Captured:
    """What the head module saw inside capture(): its input, and the placeholder it returned
    (the model's output is that very array when nothing came after the head); with `replace`
    False no placeholder, the head ran."""

    def __init__(self, replace: bool = True) -> None:
        self.replace = replace
        self.module: nn.Module | None = None
        self.hidden: mx.array | None = None
        self.placeholder: mx.array | None = None

    def apply(self, x: mx.array) -> mx.array:
        """The captured head module on another input (inside a capture(), it is recorded)."""
        embedding = isinstance(self.module, (nn.Embedding, nn.QuantizedEmbedding))
        return (self.module.as_linear if embedding else self.module)(x)


_capture = ThreadFlag(None)


@contextmanager
def capture(replace: bool = True) -> Iterator[Captured]:
    got = Captured(replace)
    with _capture.holding(got):
        yield got


def intercept(module: nn.Module, x: mx.array, vocab: int) -> mx.array | None:
    """Called by the head modules with their input: inside capture(), records it and returns
    the placeholder logits (replace) or None (compute the head); else None."""
    got = _capture.get()
    if got is None:
        return None
    got.module = module
    got.hidden = x
    if not got.replace:
        return None
    got.placeholder = mx.zeros((*x.shape[:-1], vocab), x.dtype)  # lazy: never evaluated
    return got.placeholder


def find_head(model: nn.Module) -> Captured | None:
    """The model's LM head module (Captured.module), where the model's output is the head's
    own: a one-token forward inside capture(), built and never evaluated. None where the
    head is not one of head.py's modules or something (e.g. a logit soft-cap) comes after."""
    from mlx_lm.models.cache import make_prompt_cache

    with capture() as got:
        out = model(mx.array([[0]], mx.int32), cache=make_prompt_cache(model))
    return None if got.module is None or out is not got.placeholder else got


@dataclass(frozen=True)
class Prepared:
    wq: mx.array  # uint8 [N, Kp]: round(w / scale) + 128 per row, zero past K
    stats: mx.array  # float32 [3, Np]: scale, ||w[n]||, ||w[n] - scale * q[n]||, zero past N


def prepare(weight: mx.array) -> Prepared:
    """The int8 copy of a head weight [N, K] (float32 or bfloat16) and its per-row bounds."""
    n, k = weight.shape
    kp = -(-k // _K_ALIGN) * _K_ALIGN
    np_ = -(-n // _N_ALIGN) * _N_ALIGN
    wq = np.zeros((n, kp), np.uint8)
    stats = np.zeros((3, np_), np.float32)
    for start in range(0, n, _CHUNK):
        rows = np.array(weight[start:start + _CHUNK].astype(mx.float32), np.float64)
        if not np.isfinite(rows).all():
            raise ValueError("the LM head has non-finite weights")
        scale = (np.abs(rows).max(axis=1) / 127.0).astype(np.float32)
        safe = np.where(scale > 0, scale, 1.0).astype(np.float64)  # an all-zero row: q = 0
        q = np.clip(np.rint(rows / safe[:, None]), -127, 127)
        end = start + len(rows)
        wq[start:end, :k] = (q + 128).astype(np.uint8)
        stats[0, start:end] = scale
        # Rounded up to float32: the bounds may only grow.
        stats[1, start:end] = _up(np.linalg.norm(rows, axis=1))
        stats[2, start:end] = _up(np.linalg.norm(rows - scale.astype(np.float64)[:, None] * q,
                                                 axis=1))
    return Prepared(mx.array(wq), mx.array(stats))


@dataclass(frozen=True)
class Quantized:
    """A quantized head's weight as the model holds it (mlx's affine layout)."""
    codes: mx.array  # uint32 [N, K * bits / 32]
    scales: mx.array  # [N, K / group_size]
    biases: mx.array
    group_size: int
    bits: int

    @property
    def k(self) -> int:
        return self.codes.shape[1] * 32 // self.bits


@dataclass(frozen=True)
class PreparedQuantized:
    table: mx.array  # float32 [ceil(N / 16), G, 2, 16]: 16 rows' scales of group g, then biases
    stats: mx.array  # float32 [3, Np]: 0, ||w[n]||, the bound on the screening's float rounding
    # The table as float16 for AVX2's screening (None: not prepared, or a value float16 cannot
    # hold); stats' bound then covers its rounding.
    screen: mx.array | None = None


def prepare_quantized(q: Quantized, screen: bool = False) -> PreparedQuantized:
    """The scale/bias table and per-row bounds of a quantized head (its codes are used as
    they are): 10 MB beside qwen3-small's 4-bit head of 42 MB.

    screen: also the table as float16, which the AVX2 screening reads instead (half of the
    table's 10 MB a step): qwen3-small's head at 1 row, the two tables alternated in one process
    (ms, medians of 200, two runs): 4-bit 1.59 / 1.42 vs 1.67 / 1.44, 8-bit 2.11 / 2.19 vs
    2.51 / 2.44. AVX-512 keeps the float32 table (not measured there). Its rounding is a
    weight error dW[n] = (s~ - s) q + (b~ - b) per group, which the screening's products see as
    xs xq . dW[n] <= ||xs xq|| ||dW[n]||: the same form as the bound's second term (its
    multiplier is ||xs xq||), so ||dW[n]|| joins that term's per-row factor. The exact products
    keep the float32 table."""
    n, k = q.codes.shape[0], q.k
    groups = k // q.group_size
    np_ = -(-n // _N_ALIGN) * _N_ALIGN
    table = np.zeros((np_, groups, 2), np.float32)
    stats = np.zeros((3, np_), np.float32)
    half = np.zeros((np_, groups, 2), np.float16) if screen else None
    shifts = (np.arange(32 // q.bits, dtype=np.uint32) * q.bits)[None, None, :]
    for start in range(0, n, _CHUNK):
        end = min(n, start + _CHUNK)
        words = np.array(q.codes[start:end])
        values = ((words[:, :, None] >> shifts) & ((1 << q.bits) - 1)).reshape(end - start, k)
        scales = np.array(q.scales[start:end].astype(mx.float32), np.float64)
        biases = np.array(q.biases[start:end].astype(mx.float32), np.float64)
        if not (np.isfinite(scales).all() and np.isfinite(biases).all()):
            raise ValueError("the LM head has non-finite scales or biases")
        table[start:end, :, 0] = scales
        table[start:end, :, 1] = biases
        scaled = values.astype(np.float64) * np.repeat(scales, q.group_size, axis=1)
        spread = np.repeat(biases, q.group_size, axis=1)
        stats[1, start:end] = _up(np.linalg.norm(scaled + spread, axis=1))
        # The screening sums each group's integer product times its scale, and its bias times
        # x's sum, in float32 (2 roundings a group, 1 more for x's scale): relative to the sum
        # of the terms' sizes, which ||scale * q|| + ||bias|| times ||x|| bounds. 8 to spare.
        size = np.linalg.norm(scaled, axis=1) + np.linalg.norm(spread, axis=1)
        bound = (2 * groups + 8) * 2.0**-24 * size
        if half is not None:
            with np.errstate(over="ignore"):
                s16, b16 = scales.astype(np.float16), biases.astype(np.float16)
            if not (np.isfinite(s16).all() and np.isfinite(b16).all()):
                half = None  # past float16's range: the float32 table screens
            else:
                half[start:end, :, 0], half[start:end, :, 1] = s16, b16
                dw = (values.astype(np.float64)
                      * np.repeat(s16.astype(np.float64) - scales, q.group_size, axis=1)
                      + np.repeat(b16.astype(np.float64) - biases, q.group_size, axis=1))
                bound = bound + np.linalg.norm(dw, axis=1) * (1 + 2.0**-20)
        stats[2, start:end] = _up(bound)
    return PreparedQuantized(_blocks(table), mx.array(stats),
                             None if half is None else _blocks(half))


def _blocks(table: np.ndarray) -> mx.array:
    """[Np, G, 2] -> [Np / 16, G, 2, 16]: the kernel reads a group's 16 scales as one
    vector."""
    np_, groups = table.shape[:2]
    blocks = table.reshape(np_ // _N_ALIGN, _N_ALIGN, groups, 2).transpose(0, 2, 3, 1)
    return mx.array(np.ascontiguousarray(blocks))


def quantized_qualifies(module: nn.Module) -> bool:
    """A 4-bit or 8-bit affine head whose shape the kernel takes."""
    bits, group = getattr(module, "bits", None), getattr(module, "group_size", None)
    if getattr(module, "mode", "affine") != "affine" or getattr(module, "biases", None) is None:
        return False
    if bits not in (4, 8) or group not in (32, 64, 128) or module.weight.ndim != 2:
        return False
    k = module.weight.shape[1] * 32 // bits
    return k % group == 0 and k % (128 if bits == 4 else 64) == 0


def _up(values: np.ndarray) -> np.ndarray:
    f = values.astype(np.float32)
    return np.where(f.astype(np.float64) < values, np.nextafter(f, np.float32(np.inf)), f)


class GreedyHead:
    """argmax(x @ weight.T) for the rows of x, through the kernel; with bf16_logits, of those
    logits rounded to bfloat16 (the lowest index among equal ones)."""

    def __init__(self, weight: mx.array | Quantized, kernels: Any, bf16_logits: bool = False):
        self.weight = weight
        self.kernels = kernels
        self.bf16_logits = bf16_logits
        # The float16 table only where the head's path reads it (elsewhere it would only
        # widen the bound).
        self.prepared = (prepare_quantized(weight, screen=kernels.qhead_half_table())
                         if isinstance(weight, Quantized) else prepare(weight))
        mx.eval(*self._arrays())

    def _arrays(self) -> list[mx.array]:
        fields = self.prepared.__dataclass_fields__
        return [a for a in (getattr(self.prepared, f) for f in fields) if a is not None]

    @property
    def nbytes(self) -> int:
        """What was prepared beside the model's own weights."""
        return sum(a.nbytes for a in self._arrays())

    def tokens(self, x: mx.array, allowed: np.ndarray | None = None) -> mx.array:
        """x [..., K] (one row per token; a bf16 model's exactly widened) -> int32 [...].
        allowed: uint32 [rows, words] bit masks (a grammar's, bit t of word t // 32): each
        row's argmax over the tokens its mask allows."""
        flat = x.reshape(-1, x.shape[-1]).astype(mx.float32)
        mask = None if allowed is None else mx.array(allowed)
        w, p = self.weight, self.prepared
        if isinstance(w, Quantized):
            out = self.kernels.greedy_head_quantized(flat, w.codes, p.table, p.stats,
                                                     w.group_size, w.bits, self.bf16_logits, mask,
                                                     p.screen)
        else:
            out = self.kernels.greedy_head(flat, w, p.wq, p.stats, self.bf16_logits, mask)
        return out.reshape(x.shape[:-1])


@dataclass(frozen=True)
class Probed:
    # the head's weight [vocab, hidden], float32 or bfloat16, or its quantized codes
    weight: mx.array | Quantized
    bf16_logits: bool  # the head's logits are bf16 (a bf16 model's): its argmax is theirs


def probe(model: nn.Module, quantized: bool = False) -> Probed | None:
    """What the greedy head can stand in for, or None. Builds (never evaluates) a one-token
    forward inside capture(): the model qualifies when its output is the head's placeholder
    itself (nothing, e.g. a logit soft-cap, comes after the head), the head is a dense
    float32 or bfloat16 weight (or, with `quantized`, one quantized_qualifies takes), and its
    logits are float32 or bfloat16."""
    got = find_head(model)
    if got is None:
        return None
    module = got.module
    if isinstance(module, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
        if not (quantized and quantized_qualifies(module)):
            return None
        weight: mx.array | Quantized = Quantized(module.weight, module.scales, module.biases,
                                                 module.group_size, module.bits)
    else:
        weight = module.weight
        if weight.ndim != 2 or weight.dtype not in (mx.float32, mx.bfloat16):
            return None
    # The real head on the same input (outside capture(); lazy, never evaluated): the dtype of
    # the logits whose argmax the runner would take.
    logits = got.apply(got.hidden)
    if logits.dtype not in (mx.float32, mx.bfloat16):
        return None
    return Probed(weight, logits.dtype == mx.bfloat16)
