"""mlx-lm's Qwen3 attention and MLP in few-node forms (cpu/qwen3_layers.py): for one token per
row the very values of mlx-lm's attention layer (the decode batch's paged cache, mlx-lm's own
cache, no cache), four graph nodes fewer, eight with the kernels' norms and RoPE (their fused
node), and with the runner's 4-bit and 8-bit kernels the q, k, v products and the MLP's gate,
up and SiLU one node each, still mlx-lm's tokens; prompt chunks run mlx-lm's code; only exact
Qwen3 layers are switched, once."""

from __future__ import annotations

import re
from contextlib import nullcontext

import mlx.core as mx
import pytest
from mlx_lm.models import qwen3
from mlx_lm.models.cache import KVCache, make_prompt_cache

from actors.model_runner.cpu import qwen3_layers
from actors.model_runner.decode_batch import standalone
from actors.model_runner.loading import load_model
from models.builtin import ensure_builtin


@pytest.fixture(scope="module")
def layers(model_cache):
    path = str(ensure_builtin("qwen3-tiny", cache_dir=model_cache, progress=False))
    stock, ours = load_model(path), load_model(path)
    assert qwen3_layers.apply(ours) == 3 * len(ours.model.layers)  # attention, MLP, block
    assert qwen3_layers.apply(ours) == 0  # a second call switches none
    assert type(stock.model.layers[0].self_attn) is qwen3.Attention
    return stock, ours


def _nodes(out: mx.array, tmp_path) -> list[str]:
    mx.export_to_dot(str(tmp_path / "g.dot"), out)
    return re.findall(r'label ="([^"]+)"', (tmp_path / "g.dot").read_text())


def _decode_step(model, lengths: list[int], first: int, context=None) -> mx.array:
    """The model's output for one decode step of the decode batch: rows 1.. with prompts of
    `lengths` (token first + row), each then fed token first + 30 + row (inside `context`).
    The rows' prompts are copied into a pool of the batch's own and evaluated first: the
    graph is the step's alone."""
    prompts = []
    for row, n in enumerate(lengths, 1):
        prompts.append(make_prompt_cache(model))
        mx.eval(model(mx.array([[first + row] * n]), cache=prompts[-1]))
    batch = standalone(prompts[0])
    for row, prompt in enumerate(prompts, 1):
        batch.join_copy(row, prompt)
    mx.eval(batch.positions.store.arrays())
    tokens = mx.array([0] + [first + 30 + row for row in range(1, len(lengths) + 1)],
                      dtype=mx.int32)
    with context if context is not None else nullcontext():
        return model(batch.inputs(tokens), cache=batch.caches)


def test_one_token_rows_get_mlx_lms_values_in_fewer_nodes(layers, tmp_path):
    stock, ours = layers
    a, b = stock.model.layers[0].self_attn, ours.model.layers[0].self_attn
    x = mx.random.normal((3, 1, stock.args.hidden_size), key=mx.random.key(4))
    # No cache; mlx-lm's own cache after a 5-token prompt.
    assert mx.array_equal(a(x), b(x)).item()
    caches = []
    for layer in (a, b):
        cache = KVCache()
        layer(mx.random.normal((3, 5, stock.args.hidden_size), key=mx.random.key(5)),
              cache=cache)
        caches.append(cache)
    want, got = a(x, cache=caches[0]), b(x, cache=caches[1])
    assert mx.array_equal(want, got).item()
    assert mx.array_equal(caches[0].keys[..., :6, :], caches[1].keys[..., :6, :]).item()
    # The decode batch's paged cache, rows of different lengths.
    outs = [_decode_step(model, [4, 19, 7], 5) for model in (stock, ours)]
    mine, theirs = _nodes(outs[1], tmp_path), _nodes(outs[0], tmp_path)
    assert len(theirs) - len(mine) == 4 * len(stock.model.layers), (len(theirs), len(mine))
    assert theirs.count("Transpose") - mine.count("Transpose") == 4 * len(stock.model.layers)
    assert mx.array_equal(outs[0], outs[1]).item()


def test_prompt_chunks_run_mlx_lms_code(layers, tmp_path):
    stock, ours = layers
    a, b = stock.model.layers[1].self_attn, ours.model.layers[1].self_attn
    x = mx.random.normal((2, 6, stock.args.hidden_size), key=mx.random.key(6))
    got = b(x, cache=KVCache())
    assert "Transpose" in _nodes(got, tmp_path)
    assert mx.array_equal(a(x, cache=KVCache()), got).item()


@pytest.mark.parametrize("name", ["qwen3-tiny", "qwen3-tiny-bf16"])
def test_with_the_kernels_norm_and_rope_fuse(name, model_cache, tmp_path):
    """Both models with the kernels' norms and RoPEs (norm_rope.apply), one also in one-token
    form: q's and k's reshape, norm and RoPE are one node each, the same values."""
    mk = pytest.importorskip("mas_kernels", reason="mas_kernels is not built")
    from actors.model_runner.cpu import norm_rope

    path = str(ensure_builtin(name, cache_dir=model_cache, progress=False))
    stock, ours = load_model(path), load_model(path)
    for model in (stock, ours):
        assert norm_rope.apply(model, mk) > 0
    qwen3_layers.apply(ours)
    outs = [_decode_step(model, [3, 21], 9) for model in (stock, ours)]
    mine, theirs = _nodes(outs[1], tmp_path), _nodes(outs[0], tmp_path)
    assert mine.count("MasNormRope") == 2 * len(stock.model.layers)
    assert len(theirs) - len(mine) == 8 * len(stock.model.layers), (len(theirs), len(mine))
    assert mx.array_equal(outs[0], outs[1]).item()


def test_fused_products_are_the_separate_nodes_bit_for_bit():
    mk = pytest.importorskip("mas_kernels", reason="mas_kernels is not built")
    for bits, group, m in ((4, 64, 1), (8, 32, 3), (4, 128, 40)):
        x = mx.random.normal((m, 1, 256), key=mx.random.key(bits + m))
        ws = []
        for i, n in enumerate((512, 128, 128)):
            w = mx.random.normal((n, 256), key=mx.random.key(10 + i)) * 0.05
            ws += mx.quantize(w, group_size=group, bits=bits)
        many = mk.affine_qmm_many(x, ws, group, bits)
        for i, got in enumerate(many):
            assert mx.array_equal(got, mk.affine_qmm(x, *ws[3 * i:3 * i + 3], group, bits)).item()
        got = mk.affine_swiglu(x, *ws[3:9], group, bits)
        want = mk.silu(mk.affine_qmm(x, *ws[3:6], group, bits),
                       mk.affine_qmm(x, *ws[6:9], group, bits))
        assert got.shape == (m, 1, 128) and mx.array_equal(got, want).item()
    with pytest.raises(ValueError, match="affine_qmm_many: bits must be 4 or 8"):
        mk.affine_qmm_many(x, ws, group, 3)
    with pytest.raises(ValueError, match="triples"):
        mk.affine_qmm_many(x, ws[:4], group, bits)
    with pytest.raises(ValueError, match="as many rows"):
        mk.affine_swiglu(x, *ws[0:3], *ws[3:6], group, bits)
    with pytest.raises(ValueError, match="affine_swiglu: x must be float32"):
        mk.affine_swiglu(x.astype(mx.bfloat16), *ws[3:9], group, bits)


@pytest.mark.parametrize("name", ["qwen3-tiny-4bit", "qwen3-tiny-8bit"])
def test_quantized_layers_fuse_their_products(name, model_cache, tmp_path):
    """The runner's install (cpu.install: the kernels' products, norms, RoPEs, SiLU): a decode
    step's q, k, v products one node and the MLP's gate, up and SiLU one node per layer, the
    logits of an install without the few-node forms, and greedy tokens mlx-lm's."""
    pytest.importorskip("mas_kernels", reason="mas_kernels is not built")
    from actors.model_runner import cpu
    from protocol.config import RuntimeConfig
    from harness.oracle import Oracle

    path = str(ensure_builtin(name, cache_dir=model_cache, progress=False))
    plain, ours = load_model(path), load_model(path)
    swaps = dict(qwen3_layers._SWAPS)
    qwen3_layers._SWAPS.clear()  # `plain`: the same install without the few-node forms
    try:
        cpu.install(plain, RuntimeConfig(), plain.args.vocab_size)
    finally:
        qwen3_layers._SWAPS.update(swaps)
    installed = cpu.install(ours, RuntimeConfig(), ours.args.vocab_size)
    assert installed.qwen3_layers == 3 * len(ours.model.layers)  # attention, MLP, the block
    outs = [_decode_step(model, [5, 18], 40, installed.steps()) for model in (plain, ours)]
    mine, theirs = _nodes(outs[1], tmp_path), _nodes(outs[0], tmp_path)
    layers = len(ours.model.layers)
    # Each layer: its two nodes around the two pool writes, nothing else of it.
    assert mine.count("MasDecodeLayerIn") == layers and mine.count("MasDecodeLayerOut") == layers
    assert mine.count("MasKvWrite") == 2 * layers
    assert not {"MasAffineQmmMany", "MasAffineSwiglu", "MasNormRope",
                "MasDecodeAttention"} & set(mine), sorted(set(mine))
    # The few-node forms save 12 nodes a layer, the two fused nodes 11 more.
    assert len(theirs) - len(mine) == 23 * layers, (len(theirs), len(mine))
    assert mx.array_equal(outs[0], outs[1]).item()
    # Without the decode batch's attention kernel (outside steps()) the block takes the
    # per-piece forms: mlx-lm's values still.
    plain_out = _decode_step(plain, [5, 18], 40)
    mine = _decode_step(ours, [5, 18], 40)
    assert "MasDecodeLayerIn" not in _nodes(mine, tmp_path)
    assert mx.array_equal(plain_out, mine).item()
    # Greedy tokens through the runner (compiled decode, greedy head) are mlx-lm's.
    from actors.model_runner.runner import ModelRunner
    from actors.scheduler.core import Scheduler
    from models.info import read_model_info
    from tests.support.drive import drive

    info, oracle = read_model_info(path), Oracle(path)
    ids = oracle.tokenizer.encode("The quick brown fox jumps over")
    runner = ModelRunner(load_model(path), 2, kv_slots=1 << 12, runtime=RuntimeConfig())
    sched = Scheduler(max_running=2, chunked_prefill_size=16, kv_slots=1 << 12,
                      context_length=info.context_length, eos_ids=[], output_reserve=64)
    tokens, _, _ = drive(sched, runner, {0: [("a", ids, 24)]}, 2)
    assert runner.compiled is not None and runner.compiled.off is None
    assert runner.compiled.calls > 10  # the compiled decode, traced through the fused nodes
    oracle.check(ids, tokens["a"], oracle.greedy(ids, 24))


def _layer_inputs(bits: int, group: int, rows: int, scale_dtype):
    """A decode layer's inputs: x, norms, q/k/v/o/gate/up/down quantized, page pools with each
    row's earlier tokens, the rows' pages, lengths, RoPE offsets and pool slots."""
    hidden, heads, kv_heads, dim, inner, page, pool_pages = 256, 4, 2, 64, 384, 16, 8
    key = iter(mx.random.split(mx.random.key(bits * 100 + group + rows), 32))

    def rnd(*shape, s=1.0):
        return mx.random.normal(shape, key=next(key)) * s

    def quantized(n, k):
        w, sc, b = mx.quantize(rnd(n, k, s=0.05), group_size=group, bits=bits)
        return [w, sc.astype(scale_dtype), b.astype(scale_dtype)]

    qkv = quantized(heads * dim, hidden) + quantized(kv_heads * dim, hidden) \
        + quantized(kv_heads * dim, hidden)
    rest = quantized(hidden, heads * dim) + quantized(inner, hidden) + quantized(inner, hidden) \
        + quantized(hidden, inner)
    lengths = [5 + 9 * r for r in range(rows)]  # with the new token, at position length - 1
    tables = [[(3 * r + j) % pool_pages for j in range(3)] for r in range(rows)]
    index = [h * pool_pages * page + tables[r][(n - 1) // page] * page + (n - 1) % page
             for r, n in enumerate(lengths) for h in range(kv_heads)]
    return dict(
        x=rnd(rows, 1, hidden), norm=1 + rnd(hidden, s=0.1), post=1 + rnd(hidden, s=0.1),
        q_norm=1 + rnd(dim, s=0.1), k_norm=1 + rnd(dim, s=0.1), qkv=qkv, rest=rest,
        k_pool=rnd(kv_heads, pool_pages, page, dim), v_pool=rnd(kv_heads, pool_pages, page, dim),
        pages=mx.array(tables, dtype=mx.int32), lengths=mx.array(lengths, dtype=mx.int32),
        offsets=mx.array([n - 1 for n in lengths], dtype=mx.int32),
        index=mx.array(index, dtype=mx.int32), heads=heads, kv_heads=kv_heads, dim=dim)


@pytest.mark.parametrize("bits,group,rows,scale_dtype", [
    (4, 64, 1, mx.float32), (8, 32, 3, mx.float32), (4, 128, 5, mx.bfloat16)])
def test_fused_layer_is_the_separate_nodes_bit_for_bit(bits, group, rows, scale_dtype):
    mk = pytest.importorskip("mas_kernels", reason="mas_kernels is not built")
    a = _layer_inputs(bits, group, rows, scale_dtype)
    eps, q_eps, k_eps, rope = 1e-6, 2e-6, 3e-6, (64, False, 10000.0, 1.0)
    heads, kv_heads = a["heads"], a["kv_heads"]
    # The separate nodes, as the few-node forms build them.
    normed = mk.rms_norm(a["x"], a["norm"], eps)
    q, k, v = mk.affine_qmm_many(normed, a["qkv"], group, bits)
    q = mk.norm_rope(q, a["q_norm"], q_eps, heads, *rope, a["offsets"])
    k = mk.norm_rope(k, a["k_norm"], k_eps, kv_heads, *rope, a["offsets"])
    v = v.reshape(rows, kv_heads, 1, -1)
    got = mk.decode_layer_in(a["x"], a["norm"], a["qkv"], a["q_norm"], a["k_norm"],
                             a["offsets"], heads, kv_heads, eps, q_eps, k_eps, *rope, group, bits)
    for want, mine in zip((q, k, v), got):
        assert mine.shape == want.shape and mx.array_equal(mine, want).item()
    k_pool = mk.kv_write(a["k_pool"], a["index"], k)
    v_pool = mk.kv_write(a["v_pool"], a["index"], v)
    attended = mk.decode_attention(q, k_pool, v_pool, a["pages"], a["lengths"], 0.125)
    o, g, u, d = (a["rest"][i:i + 3] for i in range(0, 12, 3))
    h = a["x"] + mk.affine_qmm(attended.reshape(rows, 1, -1), *o, group, bits)
    mlp = mk.affine_swiglu(mk.rms_norm(h, a["post"], eps), *g, *u, group, bits)
    want = h + mk.affine_qmm(mlp, *d, group, bits)
    mine = mk.decode_layer_out(a["x"], got[0], k_pool, v_pool, a["pages"], a["lengths"], 0.125,
                               a["rest"], a["post"], eps, group, bits)
    assert mine.shape == (rows, 1, 256) and mx.array_equal(mine, want).item()


def test_fused_layer_refuses_what_it_cannot_compute():
    mk = pytest.importorskip("mas_kernels", reason="mas_kernels is not built")
    a = _layer_inputs(4, 64, 2, mx.float32)
    rope = (64, False, 10000.0, 1.0)

    def layer_in(**change):
        args = dict(x=a["x"], norm=a["norm"], qkv=a["qkv"], q_norm=a["q_norm"],
                    k_norm=a["k_norm"], offsets=a["offsets"], heads=4, kv_heads=2)
        args.update(change)
        return mk.decode_layer_in(args["x"], args["norm"], args["qkv"], args["q_norm"],
                                  args["k_norm"], args["offsets"], args["heads"],
                                  args["kv_heads"], 1e-6, 1e-6, 1e-6, *rope, 64, 4)

    with pytest.raises(ValueError, match="decode_layer_in: qkv must be"):
        layer_in(qkv=a["qkv"][:6])
    with pytest.raises(ValueError, match="decode_layer_in: x must be float32 \\[rows, 1"):
        layer_in(x=a["x"].reshape(2, 256))
    with pytest.raises(ValueError, match="k and v must have 3 heads"):
        layer_in(kv_heads=3)
    with pytest.raises(ValueError, match="q_norm and k_norm must be float32 \\[64\\]"):
        layer_in(q_norm=a["q_norm"][:32])
    with pytest.raises(ValueError, match="offsets must be int32"):
        layer_in(offsets=a["offsets"].astype(mx.float32))
    q, _, _ = layer_in()

    def layer_out(weights=a["rest"], q=q, pages=a["pages"]):
        return mk.decode_layer_out(a["x"], q, a["k_pool"], a["v_pool"], pages, a["lengths"],
                                   0.125, weights, a["post"], 1e-6, 64, 4)

    with pytest.raises(ValueError, match="weights must be the \\(w, scales, biases\\)"):
        layer_out(weights=a["rest"][:9])
    with pytest.raises(ValueError, match="decode_layer_out: down: K = 384 does not match w \\(384, 32\\)"):
        layer_out(weights=a["rest"][:9] + a["rest"][3:6])
    with pytest.raises(ValueError, match="pages must be int32"):
        layer_out(pages=a["pages"].astype(mx.float32))
    with pytest.raises(ValueError, match="with x's 2 rows"):
        layer_out(q=q[:1])
    # A page id past the pool is refused when the node runs, not read.
    bad = mx.array([[0, 1, 2], [99, 1, 2]], dtype=mx.int32)
    with pytest.raises(RuntimeError, match="page id is outside the K/V pool"):
        mx.eval(layer_out(pages=bad))
