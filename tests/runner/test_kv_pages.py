"""The runner's one KV pool (actors/model_runner/kv_pages.py): the arrays double to hold the
highest page id referenced, keeping what they hold, and never pass the budget; writes land
where the flat index says and read back through page tables; a copy moves exactly the listed
slots; a prompt's chunks written through PromptKV (a shared prefix's pages among the row's)
are what mlx-lm's own cache holds, and give mlx-lm's logits."""

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models import qwen3
from mlx_lm.models.cache import KVCache, make_prompt_cache

from actors.model_runner.errors import StepError
from actors.model_runner.kv_pages import (FIRST_PAGES, PAGE, KvPages, PoolFull, PromptKV, gather,
                                          slots_of)

HEADS, DIM = 2, 8


def like(heads: int = HEADS, dim: int = DIM, dtype=mx.float32) -> KVCache:
    """A one-token cache: what KvPages.open shapes a layer's arrays after."""
    c = KVCache()
    c.update_and_fetch(mx.zeros((1, heads, 1, dim), dtype), mx.zeros((1, heads, 1, dim), dtype))
    return c


def opened(layers=(0,), limit: int | None = None) -> KvPages:
    store = KvPages(list(layers), limit)
    store.open([like() for _ in range(max(layers) + 1)])
    return store


def tokens(n: int, seed: int) -> mx.array:
    """n tokens' K or V as a write takes them: [n, kv_heads, 1, dim]."""
    return mx.random.normal((n, HEADS, 1, DIM), key=mx.random.key(seed))


def read(store: KvPages, layer: int, slots) -> tuple[np.ndarray, np.ndarray]:
    """The K and V of these slots, [n, kv_heads, dim], read straight from the arrays."""
    pages, at = np.asarray(slots) // PAGE, np.asarray(slots) % PAGE
    return tuple(np.array(a)[:, pages, at].transpose(1, 0, 2)
                 for a in (store.keys[layer], store.values[layer]))


def fill(store: KvPages, seed: int) -> None:
    """Every slot of every layer random, so a write or copy that strays shows."""
    for i, layer in enumerate(store.layers):
        for j, arrays in enumerate((store.keys, store.values)):
            arrays[layer] = mx.random.normal(arrays[layer].shape,
                                             key=mx.random.key(seed + 10 * i + j))


def test_slots_of_a_page_table():
    assert slots_of([4, 1, 9], 14, 18).tolist() == [4 * PAGE + 14, 4 * PAGE + 15, PAGE, PAGE + 1]
    assert slots_of([4, 1, 9], 32, 33).tolist() == [9 * PAGE]
    assert slots_of([3], 0, 0).tolist() == []


def test_the_arrays_double_to_the_highest_page_keeping_what_they_hold():
    store = opened()
    assert store.pages == FIRST_PAGES and store.keys[0].shape == (HEADS, FIRST_PAGES, PAGE, DIM)
    slots = [1, PAGE * 7 + 3, PAGE * FIRST_PAGES - 1]  # up to the very last slot held
    keys, values = tokens(3, 1), tokens(3, 2)
    store.write(0, store.index(np.array(slots), HEADS), keys, values)
    held = store.keys[0]
    store.ensure(FIRST_PAGES - 1)  # held already: nothing happens
    assert store.keys[0] is held
    store.ensure(FIRST_PAGES)
    assert store.pages == 2 * FIRST_PAGES
    store.ensure(5 * FIRST_PAGES)  # doubles as often as it takes, no further
    assert store.pages == 8 * FIRST_PAGES
    for arrays in (store.keys, store.values):
        assert arrays[0].shape == (HEADS, 8 * FIRST_PAGES, PAGE, DIM)
    got_k, got_v = read(store, 0, slots)
    np.testing.assert_array_equal(got_k, np.array(keys[:, :, 0]))
    np.testing.assert_array_equal(got_v, np.array(values[:, :, 0]))
    rest = np.ones(8 * FIRST_PAGES * PAGE, bool)
    rest[slots] = False  # and nothing anywhere else: the new pages are zeros
    flat = np.array(store.keys[0]).reshape(HEADS, -1, DIM)
    assert not flat[:, rest].any()


def test_the_arrays_never_pass_the_budget():
    store = opened(limit=100)
    assert store.budget_pages() == 99  # the scratch page is not the scheduler's
    store.ensure(99)
    assert store.pages == 100  # doubling stops at the limit
    with pytest.raises(PoolFull, match="KV page 100 is past the pool's 100 pages"):
        store.ensure(100)
    assert issubclass(PoolFull, StepError) and store.pages == 100
    small = opened(limit=10)  # a budget under the first size: opened at the budget
    assert small.pages == 10 and small.keys[0].shape[1] == 10
    with pytest.raises(PoolFull):
        small.copy([PAGE], [10 * PAGE])  # a copy into a page past it too


def test_held_and_nbytes_count_every_layers_arrays():
    store = opened(layers=(0, 3), limit=1000)
    per_array = HEADS * FIRST_PAGES * PAGE * DIM * 4
    assert store.nbytes == 2 * 2 * per_array  # two layers, K and V
    assert store.held() == {"kv_pool_pages": FIRST_PAGES,
                            "kv_pool_mib": round(4 * per_array / 2**20, 1)}
    store.ensure(FIRST_PAGES)
    assert store.nbytes == 8 * per_array and store.held()["kv_pool_pages"] == 2 * FIRST_PAGES
    assert KvPages([0]).budget_pages() is None


def test_the_write_index_is_each_tokens_heads_in_a_layer_seen_flat():
    store = opened()
    per_head = FIRST_PAGES * PAGE
    assert store.index(np.array([5, 40]), 2).tolist() == [5, per_head + 5, 40, per_head + 40]
    assert store.index(np.array([5, 40]), 2).dtype == mx.int32


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_writes_read_back_through_page_tables(dtype):
    store = KvPages([0])
    store.open([like(dtype=dtype)])
    table = [[7, 2, 30], [5, 1, 0]]  # out of order; a row padded with the scratch page
    lengths = [40, 20]
    written = {}
    for r, (pages, n) in enumerate(zip(table, lengths)):
        keys, values = tokens(n, 10 + r), tokens(n, 20 + r)
        store.write(0, store.index(slots_of(pages, 0, n), HEADS), keys, values)
        written[r] = keys.astype(dtype), values.astype(dtype)
    assert store.keys[0].dtype == dtype
    got_k = gather(store.keys[0], mx.array(table, dtype=mx.int32))
    got_v = gather(store.values[0], mx.array(table, dtype=mx.int32))
    assert got_k.shape == (2, HEADS, 3 * PAGE, DIM)
    for r, n in enumerate(lengths):
        want_k, want_v = written[r]
        # [heads, tokens, dim] each: the row's positions in order, wherever its pages are.
        assert mx.array_equal(got_k[r, :, :n], want_k[:, :, 0].transpose(1, 0, 2)).item()
        assert mx.array_equal(got_v[r, :, :n], want_v[:, :, 0].transpose(1, 0, 2)).item()


def test_a_copy_moves_exactly_the_listed_slots_in_every_layer():
    store = opened(layers=(1, 4))
    fill(store, seed=3)
    before = {layer: (np.array(store.keys[layer]), np.array(store.values[layer]))
              for layer in store.layers}
    # A prefix hit's partial last page: positions 32..36 of the tree's page 9 into the
    # request's page 3, plus two slots across pages the other way.
    src = [9 * PAGE + j for j in range(5)] + [2 * PAGE + 15, 6 * PAGE]
    dst = [3 * PAGE + j for j in range(5)] + [11 * PAGE + 15, 12 * PAGE]
    store.copy(src, dst)
    for layer in store.layers:
        for was, now in zip(before[layer], (store.keys[layer], store.values[layer])):
            want = was.reshape(HEADS, -1, DIM).copy()
            want[:, dst] = want[:, src]
            np.testing.assert_array_equal(np.array(now).reshape(HEADS, -1, DIM), want)
    held = store.keys[1]
    store.copy([], [])
    assert store.keys[1] is held


def test_a_copy_past_the_arrays_grows_them_first():
    store = opened()
    fill(store, seed=4)
    src = [5 * PAGE + 2]
    want_k, want_v = read(store, 0, src)
    store.copy(src, [FIRST_PAGES * PAGE + 2])
    assert store.pages == 2 * FIRST_PAGES
    got_k, got_v = read(store, 0, [FIRST_PAGES * PAGE + 2])
    np.testing.assert_array_equal(got_k, want_k)
    np.testing.assert_array_equal(got_v, want_v)


# -- prompt chunks ------------------------------------------------------------------------------


def chunk(n: int, seed: int) -> tuple[mx.array, mx.array]:
    """A chunk's K and V as the model's attention hands them over: [1, kv_heads, n, dim]."""
    return (mx.random.normal((1, HEADS, n, DIM), key=mx.random.key(seed)),
            mx.random.normal((1, HEADS, n, DIM), key=mx.random.key(seed + 500)))


def test_prompt_chunks_fetch_what_mlx_lms_cache_fetches():
    store = opened()
    pages = [7, 3]
    paged, plain = PromptKV(store, 0, pages), KVCache()
    for n, seed in ((5, 1), (23, 2)):  # the second chunk crosses into the second page
        k, v = chunk(n, seed)
        got, want = paged.update_and_fetch(k, v), plain.update_and_fetch(k, v)
        assert paged.offset == plain.offset
        for a, b in zip(got, want):
            assert a.shape == b.shape and mx.array_equal(a, b).item()
    # Written into the row's pages in position order, nowhere else.
    got_k, _ = read(store, 0, slots_of(pages, 0, 28))
    np.testing.assert_array_equal(got_k, np.array(plain.keys[0, :, :28]).transpose(1, 0, 2))
    others = np.ones(store.pages, bool)
    others[pages] = False
    assert not np.array(store.keys[0])[:, others].any()
    with pytest.raises(PoolFull, match="up to position 33 of a row with 2 pages"):
        paged.update_and_fetch(*chunk(5, 3))  # past the row's pages
    assert paged.offset == 28
    pages.append(12)  # a PAGES op extends the very list: the next chunk goes on
    k, v = chunk(5, 3)
    got, want = paged.update_and_fetch(k, v), plain.update_and_fetch(k, v)
    assert all(mx.array_equal(a, b).item() for a, b in zip(got, want))
    with pytest.raises(ValueError, match="the pool's"):
        paged.state = (k, v)


def test_a_prompt_starting_on_a_shared_prefix_reads_it_where_another_row_wrote_it():
    store = opened()
    first = PromptKV(store, 0, [2, 5])
    k_a, v_a = chunk(20, 1)
    first.update_and_fetch(k_a, v_a)
    mx.eval(store.arrays())
    written = np.array(store.keys[0]), np.array(store.values[0])
    # The second row shares page 2 (positions 0-15) and computes from 16 on, in two chunks.
    second, plain = PromptKV(store, 0, [2, 9, 4], offset=16), KVCache()
    plain.update_and_fetch(k_a[:, :, :16], v_a[:, :, :16])
    for n, seed in ((10, 7), (12, 8)):
        k, v = chunk(n, seed)
        got, want = second.update_and_fetch(k, v), plain.update_and_fetch(k, v)
        assert all(mx.array_equal(a, b).item() for a, b in zip(got, want))
    # The shared page and the first row's own page 5 are as the first row left them.
    for was, now in zip(written, (store.keys[0], store.values[0])):
        np.testing.assert_array_equal(np.array(now)[:, [2, 5]], was[:, [2, 5]])


def tiny_model() -> qwen3.Model:
    args = qwen3.ModelArgs(model_type="qwen3", hidden_size=64, num_hidden_layers=2,
                           intermediate_size=96, num_attention_heads=4, rms_norm_eps=1e-6,
                           vocab_size=101, num_key_value_heads=2, max_position_embeddings=512,
                           head_dim=16, tie_word_embeddings=True, rope_theta=10000.0)
    mx.random.seed(11)
    model = qwen3.Model(args)
    mx.eval(model.parameters())
    return model


def test_prompt_chunks_through_the_pages_give_mlx_lms_logits():
    """A random Qwen3 whose every layer's cache is PromptKV: two rows, the second starting on
    the first's whole first page, each chunk's logits are those of mlx-lm's own caches."""
    model = tiny_model()
    start = make_prompt_cache(model)
    model(mx.array([[1]]), cache=start)
    store = KvPages([0, 1])
    store.open(start)
    a = [3 + i % 50 for i in range(21)]
    b = a[:16] + [60 + i % 30 for i in range(19)]
    rows = ((a, [4, 1], 0, (9, 12)), (b, [4, 6, 8], 16, (7, 12)))
    for prompt, pages, cached, chunks in rows:
        paged = [PromptKV(store, layer, pages, cached) for layer in (0, 1)]
        plain = make_prompt_cache(model)
        if cached:
            model(mx.array([prompt[:cached]]), cache=plain)
        at = cached
        for n in chunks:
            ids = mx.array([prompt[at:at + n]])
            got, want = model(ids, cache=paged), model(ids, cache=plain)
            np.testing.assert_allclose(np.array(got), np.array(want), atol=1e-5, rtol=1e-5)
            at += n
        assert [c.offset for c in paged] == [len(prompt)] * 2
