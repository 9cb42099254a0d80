"""The gated delta rule of hybrid models' linear-attention layers off Metal
(docs/architecture.md, section 10): through the compiled kernel (mas_kernels.gated_delta, token
by token, prompt chunks and decode rows alike) where it is built, else a prompt chunk's in
blocks of matrix products (below).

Per value head, with state S (Dv x Dk), gate g_t in (0, 1], beta_t in (0, 1) and unit-norm
keys, mlx-lm's recurrence is

    S_t = g_t S_{t-1} + u_t k_t^T,   u_t = beta_t (v_t - g_t S_{t-1} k_t),   y_t = S_t q_t.

Off a GPU, mlx-lm runs it as a Python loop of small ops per token (gated_delta_ops): ~0.5 ms
per token and layer on the CPU whatever the prompt length. Unrolled over a block of C tokens
that starts from S_0, with gamma_t = g_1 ... g_t:

    S_t = gamma_t S_0 + sum_{i <= t} (gamma_t / gamma_i) u_i k_i^T,

so the new values u solve a unit lower-triangular system,

    (I + A) U = diag(beta) (V - diag(gamma) K S_0^T),
    A[t, i] = beta_t (gamma_t / gamma_i) k_t.k_i  (i < t),

and the block's outputs and final state are products:

    Y = diag(gamma) Q S_0^T + M U,   M[t, i] = (gamma_t / gamma_i) q_t.k_i  (i <= t),
    S_C = gamma_C S_0 + U^T diag(gamma_C / gamma_i) K.

Every step is a batched matmul over (batch, head) or one triangular solve of C x C, so the
work goes through the BLAS. Decay ratios are exponentials of differences of cumulative log
gates, masked before the exponential above the diagonal (never inf * 0). Same results as the
sequential form up to float rounding (tests/runner/test_chunked_delta.py). Without the kernel,
decode rows keep mlx-lm's own path; masked batches always do. The kernel beats the blocks on
the CPU (one layer of qwen3_5-small, 512 tokens: 6.9 against 18 ms): at these sizes the
blocks' time goes to MLX's per-op cost, not to their arithmetic.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

# Measured on one layer of Qwen3.5-0.8B shape (16 heads, dims 128), 2-core Xeon with MKL
# (python -m benchmarks.kernels.gated_delta): ms for the per-token loop / blocks of 64 at
# T = 2: 1.40 / 0.85, T = 8: 5.1 / 0.86, T = 128: 121 / 9.4, T = 512: 489 / 34; blocks of
# 32 / 64 / 128 / 256 at T = 2,000: 157 / 154 / 177 / 295 ms.
BLOCK = 64  # tokens per block
MIN_TOKENS = 2  # from two tokens on the blocks win; one token (decode) keeps the loop


def chunked_gated_delta(q: mx.array, k: mx.array, v: mx.array, g: mx.array, beta: mx.array,
                        state: mx.array, block: int = BLOCK) -> tuple[mx.array, mx.array]:
    """mlx-lm's gated_delta_ops (scalar gates, no mask) in blocks.

    q, k [B, T, Hk, Dk]; v [B, T, Hv, Dv]; g, beta [B, T, Hv]; state [B, Hv, Dv, Dk].
    Returns y [B, T, Hv, Dv] in q's dtype and the final state (float32)."""
    B, T, Hk, Dk = q.shape
    Hv = v.shape[2]
    if Hv // Hk > 1:
        q, k = (mx.repeat(x, Hv // Hk, axis=2) for x in (q, k))
    f32 = mx.float32
    # [B, H, T, D] for batched products over (batch, head).
    qh, kh, vh = (x.astype(f32).transpose(0, 2, 1, 3) for x in (q, k, v))
    # Log gates summed within a block reach a few hundred: in float32 their differences
    # (the decay between two nearby tokens) would keep only ~4 digits, in float64 all of
    # float32's (the CPU has float64; elsewhere float32). A gate of 0 (a full reset) is
    # taken as e^-80.
    wide = mx.float64 if mx.default_device() == mx.cpu else f32
    log_g = mx.maximum(mx.log(g.astype(wide)), -80.0).transpose(0, 2, 1)  # [B, H, T]
    bh = beta.astype(f32).transpose(0, 2, 1)
    s = state.astype(f32)
    ys = []
    for start in range(0, T, block):
        end = min(T, start + block)
        y, s = _block(qh[:, :, start:end], kh[:, :, start:end], vh[:, :, start:end],
                      log_g[:, :, start:end], bh[:, :, start:end], s)
        ys.append(y)
    y = ys[0] if len(ys) == 1 else mx.concatenate(ys, axis=2)
    return y.transpose(0, 2, 1, 3).astype(q.dtype), s


def _block(q, k, v, log_g, beta, s):
    """One block: q, k [B, H, C, Dk], v [B, H, C, Dv], log_g and beta [B, H, C], s the state
    [B, H, Dv, Dk] before it."""
    C = q.shape[2]
    f32 = mx.float32
    lg = mx.cumsum(log_g, axis=-1)  # log gamma_t
    diff = lg[..., :, None] - lg[..., None, :]  # log(gamma_t / gamma_i)
    lower = mx.tril(mx.ones((C, C), dtype=mx.bool_))
    decay = mx.exp(mx.where(lower, diff, -mx.inf)).astype(f32)  # 0 above the diagonal
    gamma = mx.exp(lg).astype(f32)[..., None]  # [B, H, C, 1]
    kk = k @ k.swapaxes(-1, -2)  # k_t . k_i
    strict = mx.tril(mx.ones((C, C), dtype=mx.bool_), k=-1)
    a = mx.where(strict, beta[..., None] * decay * kk, 0.0)
    rhs = beta[..., None] * (v - gamma * (k @ s.swapaxes(-1, -2)))  # [B, H, C, Dv]
    eye = mx.eye(C, dtype=mx.float32)
    u = mx.linalg.solve_triangular(eye + a, rhs, upper=False, stream=mx.cpu)
    m = decay * (q @ k.swapaxes(-1, -2))  # (gamma_t / gamma_i) q_t . k_i, i <= t
    y = gamma * (q @ s.swapaxes(-1, -2)) + m @ u
    tail = mx.exp(lg[..., -1:] - lg).astype(f32)[..., None]  # gamma_C / gamma_i
    s = mx.exp(lg[..., -1]).astype(f32)[..., None, None] * s + u.swapaxes(-1, -2) @ (tail * k)
    return y, s


class ShiftedConv1d(nn.Module):
    """A causal depthwise nn.Conv1d (groups = channels, stride 1, no padding, no dilation) as
    the compiled kernel (mas_kernels.causal_conv) where built, else a sum of `kernel` shifted
    products: the gated-delta layers' short convolution. On a 512-token chunk (3,072 channels,
    kernel 4): MLX's CPU convolution 46 ms, the shifted sum's elementwise passes 3.4 ms (MLX's
    strided elementwise loops), the kernel 0.6 ms. Same parameter name (`weight`, [C, kernel,
    1])."""

    def __init__(self, conv: nn.Conv1d, kernels=None):
        super().__init__()
        self.weight = conv.weight
        if "bias" in conv:
            self.bias = conv.bias
        self._kernels = kernels

    def __call__(self, x: mx.array) -> mx.array:
        w = self.weight[:, :, 0].T  # [kernel, C]
        if self._kernels is not None and x.dtype == w.dtype == mx.float32:
            y = self._kernels.causal_conv(x, w)  # the kernels are given on the CPU only
        else:
            n = x.shape[1] - w.shape[0] + 1
            y = x[:, :n] * w[0]
            for j in range(1, w.shape[0]):
                y = y + x[:, j:j + n] * w[j]
        return y + self.bias if "bias" in self else y


def depthwise(conv) -> bool:
    return (isinstance(conv, nn.Conv1d) and conv.groups == conv.weight.shape[0] > 1
            and conv.weight.shape[2] == 1 and conv.stride == 1 and conv.padding == 0
            and conv.dilation == 1)


def apply(model: nn.Module, kernels=None) -> int:
    """Swap the model's causal depthwise convolutions for ShiftedConv1d (through `kernels`,
    mas_kernels, where given). Returns the count."""
    swaps = [(parent, name) for _, parent in model.named_modules()
             for name, child in parent.children().items() if depthwise(child)]
    for parent, name in swaps:
        setattr(parent, name, ShiftedConv1d(getattr(parent, name), kernels))
    return len(swaps)


def install(enabled: bool = True, kernels=None) -> bool:
    """Route mlx-lm's ops-based recurrence (every non-Metal device) for unmasked inputs with
    scalar gates (`enabled`) through the compiled token-by-token kernel (`kernels`, the
    mas_kernels module: every length, decode rows too), or else through the blocks from
    MIN_TOKENS tokens on; or restore mlx-lm's own. Idempotent (a second call updates the
    kernels); returns whether a replacement is in use."""
    from mlx_lm.models import gated_delta

    current = gated_delta.gated_delta_ops
    patched = getattr(current, "_mas_chunked", False)
    if not enabled:
        if patched:
            gated_delta.gated_delta_ops = current.reference
        return False
    reference = current.reference if patched else current

    def dispatch(q, k, v, g, beta, state=None, mask=None):
        if mask is None and g.ndim == 3:
            if state is None:
                B, _, _, Dk = q.shape
                state = mx.zeros((B, v.shape[2], v.shape[3], Dk), dtype=mx.float32)
            if kernels is not None and q.shape[-1] % 16 == 0:
                f32 = mx.float32
                y, s = kernels.gated_delta(*(x.astype(f32) for x in (q, k, v, g, beta, state)))
                return y.astype(q.dtype), s
            if q.shape[1] >= MIN_TOKENS:
                return chunked_gated_delta(q, k, v, g, beta, state)
        return reference(q, k, v, g, beta, state, mask)

    dispatch._mas_chunked = True
    dispatch.reference = reference
    dispatch.kernels = kernels
    gated_delta.gated_delta_ops = dispatch
    return True
