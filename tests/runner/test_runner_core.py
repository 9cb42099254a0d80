"""The runner core driven by the real scheduler core (no sockets) on real built-in models:
requests joining and leaving the batch at different steps still get mlx-lm's greedy tokens,
for the dense (qwen3) and the hybrid (qwen3_5) model."""


import mlx.core as mx
import pytest
from mlx_lm.models.cache import make_prompt_cache

from actors.model_runner.cpu import fastmath, greedy_head, weights
from models.builtin import ensure_builtin
from actors.model_runner.loading import load_model
from models.info import read_model_info
from actors.model_runner.rows import StepError
from actors.model_runner.runner import ModelRunner
from actors.model_runner import kv_pages
from actors.model_runner.kv_pages import PAGE
from actors.model_runner.storage import HEAD_INPUT
from actors.model_runner.windows import window_of
from actors.scheduler.core import Scheduler
from actors.scheduler.prefix_plan import plan_prefix
from protocol import messages as m
from protocol.codec import pack_ids
from protocol.config import RuntimeConfig
from harness.oracle import Oracle
from tests.support.drive import check_all, drive, run

PROMPTS = ["Hello world", "中文的自然语言处理", "def f(x):\n    return", "🎉🚀 emoji",
           "The quick brown fox jumps over the lazy dog. " * 20]


@pytest.fixture(scope="module", params=["qwen3-tiny", "qwen3_5-tiny", "gemma3-tiny"])
def setup(request, model_cache):
    path = str(ensure_builtin(request.param, cache_dir=model_cache, progress=False))
    oracle = Oracle(path)
    return path, oracle, read_model_info(path)


def _arrivals(oracle):
    ids = [oracle.tokenizer.encode(p) for p in PROMPTS]
    # Five requests through three rows, arriving at different steps, with different lengths:
    # rows are reused and the batched cache is filtered and extended many times; the long
    # prompt is prefilled in chunks of 16 beside running decodes.
    return {0: [("a", ids[0], 12), ("b", ids[1], 5)], 3: [("c", ids[2], 9)],
            4: [("d", ids[3], 7)], 6: [("e", ids[4], 10)]}


@pytest.mark.parametrize("depth", [1, 2], ids=["plain", "overlap"])
def test_staggered_chunked_batch_matches_mlx_lm(setup, depth):
    path, oracle, info = setup
    arrivals = _arrivals(oracle)
    got, _ = run(path, info, arrivals, depth=depth)
    check_all(oracle, arrivals, got)


def test_a_burst_prefills_first_and_the_held_rows_go_on_as_mlx_lm(setup):
    """scheduler.prefill_first: two rows decode, then five requests arrive at once: while
    more wait than decode, steps only prefill (the runner runs no decode forward, the held
    rows' caches and last tokens stay), then everyone decodes; every request's tokens are
    mlx-lm's, the held ones' too. With overlap: a held step is built while the step before
    it, which decodes those rows, is still in flight (the scheduler's side of both depths is
    in tests/core/test_scheduler_properties.py)."""
    path, oracle, info = setup
    ids = [oracle.tokenizer.encode(p) for p in PROMPTS]
    arrivals = {0: [("a", ids[0], 14), ("b", ids[2], 12)],
                3: [(rid, ids[k % len(ids)], 6) for k, rid in enumerate("cdefg", start=1)]}
    got, sched = run(path, info, arrivals, max_rows=7, depth=2, prefill_first=True)
    check_all(oracle, arrivals, got)
    held = [b for b in sched.batches if b.hold_decode]
    assert held, "no step held the decoding rows"
    assert all(not any(b.future) for b in held)
    # Held steps come while the burst is admitted; decoding resumes after them.
    last_held = max(b.step for b in held)
    assert any(any(b.future) for b in sched.batches if b.step > last_held)


def test_plain_greedy_steps_take_the_greedy_head(setup, monkeypatch):
    """With the compiled kernels, plain greedy decode steps (and prompts sampled alone) ask
    the greedy head (cpu/greedy_head.py), not the full LM head; the tokens stay mlx-lm's."""
    pytest.importorskip("mas_kernels")
    from actors.model_runner.cpu.greedy_head import GreedyHead

    calls = []
    tokens = GreedyHead.tokens
    monkeypatch.setattr(GreedyHead, "tokens", lambda self, x, allowed=None:
                        calls.append(x.shape) or tokens(self, x, allowed))
    path, oracle, info = setup
    arrivals = _arrivals(oracle)
    got, _ = run(path, info, arrivals)
    check_all(oracle, arrivals, got)
    assert len(calls) >= sum(n for reqs in arrivals.values() for _, _, n in reqs) // 3
    assert any(shape[0] > 1 for shape in calls)  # batched decode rows


def test_decode_steps_take_the_attention_kernel(setup, monkeypatch):
    """With the compiled kernels, every full-attention layer of a decode step asks
    mas_kernels.decode_attention (cpu/attention.py), and the tokens stay mlx-lm's."""
    mk = pytest.importorskip("mas_kernels")
    calls = []
    real = mk.decode_attention
    monkeypatch.setattr(mk, "decode_attention", lambda *a: calls.append(1) or real(*a))
    path, oracle, info = setup
    arrivals = _arrivals(oracle)
    # Counted in Python, so the forward built every step: a compiled one calls the kernel's
    # binding only while tracing (its replays run the traced node).
    got, _ = run(path, info, arrivals, runtime=RuntimeConfig(compile_decode=False))
    check_all(oracle, arrivals, got)
    full = len(load_model(path).layers) - info.state_layers
    assert len(calls) >= full * sum(n for reqs in arrivals.values() for _, _, n in reqs) // 3


@pytest.mark.parametrize("depth", [1, 2], ids=["plain", "overlap"])
def test_retraction_under_a_tiny_kv_budget_keeps_tokens_identical(setup, depth):
    path, oracle, info = setup
    ids = [oracle.tokenizer.encode(p * 8)[:20] for p in PROMPTS]
    # Three requests of 20 + 30 tokens in 100 slots, and no output reserve: all are admitted
    # and then run out of slots while decoding, so the least advanced ones are retracted and
    # recomputed later from prompt + output.
    arrivals = {0: [("a", ids[0], 30), ("b", ids[1], 30), ("c", ids[2], 30)],
                5: [("d", ids[3], 30)]}
    got, sched = run(path, info, arrivals, depth=depth, kv_slots=100, reserve=0)
    assert sched.retractions > 0, "the budget was meant to force retraction"
    check_all(oracle, arrivals, got)


def test_a_decode_row_that_was_never_prefilled_is_refused(setup):
    path, _, _ = setup
    runner = ModelRunner(load_model(path), 2)
    batch = m.ForwardBatch(step=1, rows=[1], input_lens=[1], start_pos=[5], future=[True],
                           sample=[True], input_ids=b"")
    with pytest.raises(StepError, match="never prefilled"):
        runner.step(batch)


def test_a_new_runner_has_the_first_pages_of_its_kv_pool_in_memory(setup):
    """Faulted in at startup, shaped like the model's K and V, never past the budget's pages
    (and the scratch page): the first request writes into memory that is already there."""
    path, _, _ = setup
    model = load_model(path)
    cache = make_prompt_cache(model)
    model(mx.array([[1, 2]]), cache=cache)
    for budget, pages in ((100, 100 // PAGE + 1), (1 << 16, kv_pages.FIRST_PAGES)):
        pool = ModelRunner(model, 2, kv_slots=budget).pools.kv
        assert sorted(pool.keys) == sorted(pool.values) == pool.layers
        assert pool.pages == pages and pool.budget_pages() == budget // PAGE
        for layer in pool.layers:
            want = cache[layer].keys
            for store in (pool.keys, pool.values):
                assert store[layer].shape == (want.shape[1], pages, PAGE, want.shape[3])
                assert store[layer].dtype == want.dtype
    assert ModelRunner(model, 2).pools.kv.limit is None  # no budget: it grows as pages come


def ops_batch(step: int, *ops: m.Op, admit: dict[int, int] | None = None, prompt=None,
              start: int = 0) -> m.ForwardBatch:
    """A batch of ops (and one prompt chunk of row 1 at `start`, where given); admit: row ->
    its live state slot."""
    admit = admit or {}
    ids = list(prompt or [])
    return m.ForwardBatch(step=step, rows=[1] if ids else [], input_lens=[len(ids)] if ids else [],
                          start_pos=[start] if ids else [], future=[False] if ids else [],
                          sample=[True] if ids else [], input_ids=pack_ids(ids),
                          ops=list(ops), admit_rows=list(admit),
                          admit_params=[m.SamplingParams(max_new_tokens=1)] * len(admit),
                          admit_states=list(admit.values()))


def pages_op(row: int, start: int, pages: list[int]) -> m.Op:
    return m.Op(kind=m.OpKind.PAGES, dst=row, start=start, slots=pack_ids(pages))


def test_ops_the_runner_cannot_carry_out_are_refused(setup):
    path, _, info = setup
    model = load_model(path)
    bare = ModelRunner(model, 2)  # no state slots: no state pool
    with pytest.raises(StepError, match="a state op, but this runner has no state pool"):
        bare.step(ops_batch(1, m.Op(kind=m.OpKind.CLEAR, dst=1)))
    budget = ModelRunner(model, 2, kv_slots=64, state_slots=4)
    with pytest.raises(StepError, match="page 0 is the scratch page"):
        budget.step(ops_batch(1, pages_op(1, 0, [0, 1])))
    with pytest.raises(StepError, match=r"KV page 5 is past the pool's 5 pages"):
        budget.step(ops_batch(1, pages_op(1, 0, [1, 5])))
    with pytest.raises(StepError, match="pages from index 3 of a table of 1"):
        budget.step(ops_batch(1, pages_op(1, 0, [1]), pages_op(1, 3, [2])))
    with pytest.raises(StepError, match="a KV copy of 3 slot ids"):
        budget.step(ops_batch(1, m.Op(kind=m.OpKind.KV_COPY, slots=pack_ids([16, 17, 32]))))
    with pytest.raises(StepError, match="prompt starts at 40 with 2 pages"):
        budget.step(ops_batch(1, pages_op(1, 0, [1, 2]), admit={1: 0}, prompt=[5], start=40))
    if info.state_layers:  # a prefix of its recurrent or sliding layers needs a state slot
        with pytest.raises(StepError, match=r"row 1 starts at 16, but layers \[[0-9, ]+\] "
                           "resume from a state slot and it has none"):
            ModelRunner(model, 2, kv_slots=64).step(
                ops_batch(1, pages_op(1, 0, [1, 2]), admit={1: -1}, prompt=[5], start=16))


def test_a_row_donates_only_the_state_slot_it_owns(setup):
    path, _, _ = setup
    runner = ModelRunner(load_model(path), 2)
    runner.step(ops_batch(1, admit={1: 2}))
    with pytest.raises(StepError, match="row 1 donates state slot 3, but its live state is 2"):
        runner.step(ops_batch(2, m.Op(kind=m.OpKind.DONATE, src=3, dst=1)))
    runner.step(ops_batch(3, m.Op(kind=m.OpKind.DONATE, src=2, dst=1)))
    assert runner.rows.holder(2) is None  # the slot is the tree's now
    with pytest.raises(StepError, match="donates state slot 2, but its live state is None"):
        runner.step(ops_batch(4, m.Op(kind=m.OpKind.DONATE, src=2, dst=1)))


@pytest.mark.parametrize("head_input", [True, False], ids=["head-input", "last-token"])
def test_prefix_cache_hits_keep_tokens_identical(setup, head_input):
    """Same prompt twice, a shared system prompt with different user turns, a multi-turn chat
    that appends to the last turn, concurrent requests sharing a prefix; overlap on, prompts
    chunked so prefixes are also cached at chunk boundaries (hybrid: with state snapshots;
    an exact repeat sampled from the head input kept at the prompt's end, or running the
    prompt's last token again)."""
    path, oracle, info = setup
    if head_input and not info.state_layers:
        pytest.skip("a dense model's hits run the prompt's last token")
    enc = oracle.tokenizer.encode
    system = enc("You are a helpful assistant. " * 6)
    turn1 = system + enc(" User: hello there")
    reply1 = oracle.greedy(turn1, 6)
    turn2 = turn1 + reply1 + enc(" User: and then?")
    arrivals = {
        0: [("same1", enc("The quick brown fox " * 5), 8), ("sys-a", system + enc(" Q: 1+1?"), 6)],
        14: [("same2", enc("The quick brown fox " * 5), 8), ("sys-b", system + enc(" Q: why?"), 6),
             ("turn1", turn1, 6)],
        30: [("turn2", turn2, 6), ("c1", system + enc(" alpha"), 5), ("c2", system + enc(" beta"), 5)],
    }
    got, sched = run(path, info, arrivals, depth=2, prefix=True, chunk=16, head_input=head_input)
    check_all(oracle, arrivals, got)
    cached = {rid: f.cached_tokens for rid, f in sched.finished.items()}
    assert cached["same1"] == 0 and cached["same2"] > 0
    same = len(enc("The quick brown fox " * 5))
    assert cached["same2"] == (same if info.state_layers and head_input else same - 1)
    assert cached["sys-b"] >= 16 and cached["turn2"] > len(turn1) - 16
    assert sched.memory.hits >= 4


def test_eviction_under_a_small_budget_keeps_tokens_identical(setup):
    path, oracle, info = setup
    enc = oracle.tokenizer.encode
    prompts = [enc(f"Story number {k}: once upon a time " * 4) for k in range(6)]
    arrivals = {3 * k: [(f"s{k}", p, 6)] for k, p in enumerate(prompts)}
    arrivals[30] = [("again", prompts[-1], 6)]
    # Pages for two requests and one more: a hit locks the pages of its whole match (the
    # first one mixes two requests' slots, where their prompts part, so it is copied).
    pages = -(-(max(len(p) for p in prompts) + 6) // PAGE)
    got, sched = run(path, info, arrivals, max_rows=2, depth=2, prefix=True,
                     kv_slots=(2 * pages + 1) * PAGE)
    check_all(oracle, arrivals, got)
    assert sched.memory.evicted_tokens > 0, "the budget was meant to force eviction"
    assert sched.finished["again"].cached_tokens > 0


@pytest.mark.parametrize("depth", [1, 2], ids=["plain", "overlap"])
def test_long_chunks_take_the_fast_softmax_and_keep_tokens_identical(setup, depth, monkeypatch):
    """Prefill chunks of 256 (scores and SiLU far above fastmath.MIN_ELEMENTS) beside decodes
    of eight rows: the fast softmax (the compiled kernel where built, else NumPy) runs in the
    runner's steps and the tokens stay mlx-lm's."""
    path, oracle, info = setup
    calls = []
    try:
        import mas_kernels as owner  # the runner installs fastmath with the kernels
    except ImportError:
        owner = fastmath
    fast_softmax = owner.softmax

    def counted_softmax(scores, *args):
        calls.append(scores.shape)
        return fast_softmax(scores, *args)

    monkeypatch.setattr(owner, "softmax", counted_softmax)
    ids = [oracle.tokenizer.encode(f"{k}: " + p * 30)[:180 + 10 * k] for k, p in
           enumerate(PROMPTS)]
    arrivals = {0: [(f"r{k}", p, 8) for k, p in enumerate(ids[:3])],
                2: [(f"s{k}", p, 6) for k, p in enumerate(ids[3:] + ids[:3])]}
    got, _ = run(path, info, arrivals, max_rows=8, depth=depth, chunk=256)
    check_all(oracle, arrivals, got)
    assert any(shape[-2] >= 180 for shape in calls), calls  # prefill chunks


@pytest.mark.parametrize("depth", [1, 2], ids=["plain", "overlap"])
def test_one_token_prompts_alone_and_beside_decodes_match_mlx_lm(setup, depth):
    """A one-token prompt has an empty cache: it runs on its own (head on its one position)
    and joins the decode batch only after that step's decode forward, alone or not."""
    path, oracle, info = setup
    long = oracle.tokenizer.encode(PROMPTS[4])
    arrivals = {0: [("alone", [9707], 6)],
                12: [("long", long, 12)],
                16: [("beside", [1879], 6), ("two", [9707, 1879], 5)]}
    got, _ = run(path, info, arrivals, depth=depth, chunk=64)
    check_all(oracle, arrivals, got)


def _step(runner, step, rows=(), prompts=None, ops=(), admit=None, start=None):
    """One hand-built step: `prompts` row -> ids (whole prompts, sampled, each in 8 pages of
    its row's own), the other rows decode their futures; admit: row -> its live state slot."""
    prompts, admit = prompts or {}, admit or {}
    ops = [pages_op(r, 0, list(range(8 * r + 1, 8 * r + 9))) for r in prompts] + list(ops)
    rows = [*prompts, *rows]
    ids = [t for p in prompts.values() for t in p]
    batch = m.ForwardBatch(
        step=step, rows=rows, input_lens=[len(prompts.get(r, [0])) for r in rows],
        start_pos=[0 if r in prompts else start[r] for r in rows],
        future=[r not in prompts for r in rows], sample=[True] * len(rows),
        input_ids=pack_ids(ids), ops=list(ops), admit_rows=list(admit),
        admit_params=[m.SamplingParams(max_new_tokens=64)] * len(admit),
        admit_states=list(admit.values()))
    return runner.step(batch).tokens


def test_state_slots_hold_what_ops_keep_and_nothing_else(setup, model_cache):
    """No step writes a live state anywhere; a snapshot of a decoding row is its state (a
    sliding layer's: its window) after the tokens it ran (mlx-lm's own cache, run over them sequentially, is the reference) and
    the LM head's input at the last of them (where an exact repeat samples from); a row that
    parks keeps both while the forward runs its position for others."""
    path, oracle, info = setup
    if not info.state_layers:
        pytest.skip("a dense model has no recurrent state or window")

    model = load_model(path)
    runner = ModelRunner(model, 2, state_slots=8)
    pool = runner.pools.states
    p, q = oracle.tokenizer.encode(PROMPTS[2]), oracle.tokenizer.encode(PROMPTS[0])
    out = _step(runner, 1, prompts={1: p}, ops=[m.Op(kind=m.OpKind.CLEAR, dst=0)],
                admit={1: 0})
    for step in range(2, 5):
        out += _step(runner, step, rows=[1], start={1: len(p) + step - 2})
        assert pool.held == {}  # decoding writes nothing

    def reference(tokens):
        """The state after the tokens, the head's input at the last one, and (the greedy
        head's kept answer, where it ran) the argmax there."""
        cache = make_prompt_cache(model)
        with greedy_head.capture(replace=False) as head_in:
            logits = model(mx.array(tokens)[None], cache=cache)
        return {**{i: cache[i].cache for i in runner.layers.linear},
                **{i: window_of(cache[i]) for i in runner.layers.windows},
                HEAD_INPUT: [head_in.hidden[0, -1], mx.argmax(logits[0, -1]).astype(mx.int32)]}

    def assert_close(got, want):
        assert set(got) == set(want)
        if runner.cpu.greedy is None:  # no greedy head: no token kept beside the input
            want[HEAD_INPUT] = want[HEAD_INPUT][:1]
        assert len(got[HEAD_INPUT]) == len(want[HEAD_INPUT])
        for i in want:
            for a, b in zip(got[i], want[i]):
                assert a.shape == b.shape
                # Within 1e-4 of the array's scale (the head input's is ~100, its order of
                # sums not the reference's).
                err, scale = mx.abs(a - b).max().item(), mx.abs(b).max().item()
                assert err <= 1e-4 * (1 + scale), (i, err, scale)

    ran = p + out[:-1]  # the last sample has not run yet
    # Row 1 does not decode from here on: it parks.
    _step(runner, 5, prompts={2: q}, ops=[m.Op(kind=m.OpKind.SNAPSHOT, src=0, dst=5),
                                          m.Op(kind=m.OpKind.CLEAR, dst=1)], admit={2: 1})
    assert_close(pool.held[5], reference(ran))
    # Row 2 decodes; the forward runs row 1's parked position beside it.
    _step(runner, 6, rows=[2], start={2: len(q)})
    _step(runner, 7, rows=[2], start={2: len(q) + 1})
    _step(runner, 8, ops=[m.Op(kind=m.OpKind.DONATE, src=0, dst=1)])
    assert_close(pool.held[0], reference(ran))
    assert runner.rows.holder(0) is None and runner.rows.holder(1) == 2


def test_on_the_cpu_a_step_is_sent_before_the_next_one_is_queued(setup):
    """MLX's CPU eval runs a graph as it is queued (async_eval returns with little left), so
    the runner reads step N back once step N+1's graph is built and before it is queued: the
    Pipeline sends N while launching N+1, not after it (one step earlier to the client).
    Except a plain decode step of a compiled attention-only model (runner.early_queue): that
    one is queued first, then N is read back, with the tokens of steps run one at a time and
    no pool copied for a write."""
    import mas_kernels as mk

    from actors.model_runner.pipeline import Pipeline

    path, oracle, _ = setup
    runner = ModelRunner(load_model(path), 2)
    alone = ModelRunner(load_model(path), 2)
    calls, tokens = [], {}

    class Thread:
        log = None

        def __init__(self):
            self.runner = self

        def launch(self, b):
            got = runner.launch(b)
            calls.append(("queued", b.step))
            return got

        def finish(self, launched):
            return runner.finish(launched)

        def send(self, result, started):
            calls.append(("sent", result.step))
            tokens[result.step] = result.tokens

    pipe = Pipeline(Thread())
    p = oracle.tokenizer.encode(PROMPTS[0])
    batches = [m.ForwardBatch(step=1, rows=[1], input_lens=[len(p)], start_pos=[0],
                              future=[False], sample=[True], input_ids=pack_ids(p),
                              admit_rows=[1], admit_params=[m.SamplingParams(max_new_tokens=5)],
                              ops=[pages_op(1, 0, list(range(1, 2 + (len(p) + 5) // PAGE)))])]
    batches += [m.ForwardBatch(step=step, rows=[1], input_lens=[1], start_pos=[len(p) + step - 2],
                               future=[True], sample=[True], input_ids=b"")
                for step in (2, 3, 4)]
    copies = mk._ext._kv_write_copies()
    for b in batches:
        pipe.launch(b)
    pipe.flush()
    if runner.early_queue:  # step 2 (the row joins the decode batch) reads step 1 back first
        assert calls == [("queued", 1), ("sent", 1), ("queued", 2), ("queued", 3), ("sent", 2),
                         ("queued", 4), ("sent", 3), ("sent", 4)], calls
        assert mk._ext._kv_write_copies() == copies
    else:
        assert calls == [x for b in batches for x in (("queued", b.step), ("sent", b.step))]
    assert tokens == {b.step: alone.step(b).tokens for b in batches}


@pytest.mark.parametrize("greedy", [True, False], ids=["greedy-head", "full-head"])
@pytest.mark.parametrize("depth", [1, 2], ids=["plain", "overlap"])
def test_exact_repeats_sample_from_the_head_input_kept_with_the_prompt(setup, depth,
                                                                        greedy, monkeypatch):
    """Hybrid: a prompt's end is cached with the LM head's input there, so a repeat (of one
    that ended at its first token, and of one that decoded on) is admitted with its whole
    prompt cached and only samples, a row with no input token; through the greedy head and
    through the model's own head, beside other rows decoding, the tokens stay mlx-lm's."""
    path, oracle, info = setup
    if not info.state_layers:
        pytest.skip("a dense model's hits run the prompt's last token")
    ids = [oracle.tokenizer.encode(p) for p in PROMPTS]
    arrivals = {0: [("once", ids[2], 1), ("on", ids[0], 8)],
                12: [("once-again", ids[2], 6), ("on-again", ids[0], 5), ("other", ids[1], 9)],
                14: [("again-beside", ids[2], 4)]}
    applied = []
    apply = greedy_head.Captured.apply

    def counted(self, x):  # inside a step's capture(): not greedy_head.probe's call at load
        if greedy_head._capture.get() is not None:
            applied.append(x.shape)
        return apply(self, x)

    monkeypatch.setattr(greedy_head.Captured, "apply", counted)
    got, sched = run(path, info, arrivals, depth=depth, prefix=True,
                     runtime=RuntimeConfig(greedy_head=greedy))
    check_all(oracle, arrivals, got)
    # The greedy head's token was kept with the input (the first sends were greedy too):
    # no head runs for a repeat. Without it the model's head runs on the kept input.
    kept_tokens = greedy and weights.loaded_kernels() is not None
    assert len(applied) == (0 if kept_tokens else 3)
    cached = {rid: f.cached_tokens for rid, f in sched.finished.items()}
    for rid, prompt in (("once-again", ids[2]), ("on-again", ids[0]),
                        ("again-beside", ids[2])):
        assert cached[rid] == len(prompt), rid
    sampled_only = sum(n == 0 and not f for b in sched.batches
                       for n, f in zip(b.input_lens, b.future))
    assert sampled_only == 3
