"""What an evaluation harness (lm-evaluation-harness's local-completions) needs from
/v1/completions, with the official `openai` client and the exact bodies lm-eval sends: echo
with prompt logprobs equal to mlx-lm's own log_softmax (within 1e-4 at every position), with
max_tokens 0, chunked prefill, a prefix hit on part of the prompt, beside other requests, on
the dense and the hybrid built-ins; several prompts per request with n choices, numbered as
OpenAI and vLLM number them."""

from __future__ import annotations

import json
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import openai
import pytest

from harness.graph import Graph
from models.builtin import ensure_builtin
from harness.oracle import Oracle

pytestmark = pytest.mark.slow

TEXTS = ["The quick brown fox jumps over the lazy dog while the cat sleeps in the sun.",
         "Once upon a time, in a land far away, there lived a small robot named Bolt.",
         "def add(a, b):\n    return a + b\n\nprint(add(2, 3))",
         "中文的自然语言处理很有趣，也很难。"]


@pytest.fixture(scope="module", params=["qwen3-tiny", "qwen3_5-tiny"])
def served(request, model_cache):
    """The graph with prompt chunks of 16 tokens (every prompt here is longer), the prefix
    cache on, and small request limits; the oracle on the same model."""
    path = ensure_builtin(request.param, cache_dir=model_cache, progress=False)
    g = Graph(f"model.builtin={request.param}", "scheduler.chunked_prefill_size=16",
              "limits.max_request_tokens=300", "limits.max_prompts=8",
              "limits.max_choices=64")
    api = openai.OpenAI(base_url=g.http + "/v1", api_key="unused", max_retries=0)
    yield g, api, Oracle(str(path)), request.param
    assert g.stop() == 0


def ids_of(oracle, text):
    return oracle.tokenizer.encode(text)


# 1e-4, and float32's relative error on the tiny random models' very unlikely tokens (their
# logprobs reach -40 to -60 nats, where chunked and whole-prompt forwards differ by ~3e-4).
TOL = dict(atol=1e-4, rtol=1e-5)


def assert_echo(oracle, ids, logprobs, generated=0):
    """logprobs: a choice's legacy logprobs with echo: the prompt's tokens first."""
    want, _ = oracle.prompt_logprobs(ids)
    assert len(logprobs.token_logprobs) == len(ids) + generated
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    np.testing.assert_allclose(logprobs.token_logprobs[1:len(ids)], want, **TOL)
    assert logprobs.tokens[:len(ids)] == [oracle.tokenizer.decode([i]) for i in ids]


def test_echo_scores_every_prompt_position_as_mlx_lm(served):
    _, api, oracle, name = served
    ids = ids_of(oracle, TEXTS[0])
    r = api.completions.create(model=name, prompt=ids, max_tokens=3, temperature=0,
                               logprobs=2, echo=True)
    c = r.choices[0]
    assert_echo(oracle, ids, c.logprobs, generated=3)
    assert c.text.startswith(TEXTS[0]) and len(c.text) > len(TEXTS[0])
    assert all(len(t) == 2 for t in c.logprobs.top_logprobs[1:])
    # The generated tokens are mlx-lm's greedy ones, with their logprobs after the prompt's.
    greedy = oracle.greedy(ids, 3)
    assert c.logprobs.tokens[len(ids):] == [oracle.tokenizer.decode([t]) for t in greedy]
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ids), 3)


def test_max_tokens_0_scores_the_prompt_alone(served):
    _, api, oracle, name = served
    ids = ids_of(oracle, TEXTS[1])
    r = api.completions.create(model=name, prompt=ids, max_tokens=0, temperature=0,
                               logprobs=1, echo=True)
    c = r.choices[0]
    assert c.text == TEXTS[1] and c.finish_reason == "length"
    assert_echo(oracle, ids, c.logprobs)
    assert r.usage.completion_tokens == 0
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        api.completions.create(model=name, prompt=ids, max_tokens=0)


def test_a_prefix_hit_covers_only_what_comes_before_the_scores(served):
    _, api, oracle, name = served
    head = ids_of(oracle, TEXTS[2])
    api.completions.create(model=name, prompt=head, max_tokens=1, temperature=0)
    ids = head + ids_of(oracle, " And then it printed five.")
    r = api.completions.create(model=name, prompt=ids, max_tokens=0, logprobs=1, echo=True)
    assert_echo(oracle, ids, r.choices[0].logprobs)
    # Prompt logprobs from position 0 leave nothing to take from the cache.
    assert r.usage.prompt_tokens_details.cached_tokens == 0
    plain = api.completions.create(model=name, prompt=ids, max_tokens=1, temperature=0)
    assert plain.usage.prompt_tokens_details.cached_tokens > 0


def test_echo_beside_other_requests_and_streamed(served):
    _, api, oracle, name = served
    prompts = [ids_of(oracle, t) for t in TEXTS]

    def score(ids):
        return api.completions.create(model=name, prompt=ids, max_tokens=2, temperature=0,
                                      logprobs=1, echo=True)

    def plain(k):
        return api.completions.create(model=name, prompt=f"Count to {k}:", max_tokens=24,
                                      temperature=0)

    with ThreadPoolExecutor(8) as pool:
        others = [pool.submit(plain, k) for k in range(4)]
        scored = list(pool.map(score, prompts))
        assert all(o.result().usage.completion_tokens for o in others)
    for ids, r in zip(prompts, scored):
        assert_echo(oracle, ids, r.choices[0].logprobs, generated=2)
    # Streamed: the prompt's piece first, then the generated tokens.
    ids = prompts[0]
    chunks = list(api.completions.create(model=name, prompt=ids, max_tokens=2, temperature=0,
                                         logprobs=1, echo=True, stream=True))
    first = chunks[0].choices[0]
    assert first.text == TEXTS[0]
    assert len(first.logprobs.token_logprobs) == len(ids)
    np.testing.assert_allclose(first.logprobs.token_logprobs[1:],
                               oracle.prompt_logprobs(ids)[0], **TOL)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == scored[0].choices[0].text


def test_several_prompts_with_n_choices_are_numbered_prompt_by_prompt(served):
    _, api, oracle, name = served
    prompts = [ids_of(oracle, t)[:12] for t in TEXTS]
    r = api.completions.create(model=name, prompt=prompts, n=2, max_tokens=4, temperature=0)
    assert sorted(c.index for c in r.choices) == list(range(8))
    by_index = {c.index: c for c in r.choices}
    for p, ids in enumerate(prompts):
        want = oracle.tokenizer.decode(oracle.greedy(ids, 4))
        assert by_index[2 * p].text == by_index[2 * p + 1].text == want
    assert r.usage.prompt_tokens == sum(map(len, prompts))
    assert r.usage.completion_tokens == 8 * 4
    texts = api.completions.create(model=name, prompt=TEXTS[:3], max_tokens=3, temperature=0)
    assert [c.index for c in texts.choices] == [0, 1, 2]
    for c, t in zip(texts.choices, TEXTS):
        assert c.text == oracle.tokenizer.decode(oracle.greedy(ids_of(oracle, t), 3))
    with pytest.raises(openai.BadRequestError, match=r"prompt\[1\]"):
        api.completions.create(model=name, prompt=[prompts[0], [999_999_999]], max_tokens=2)
    with pytest.raises(openai.BadRequestError, match=r"prompt\[2\]"):
        api.completions.create(model=name, prompt=["a", "b", [1.5]], max_tokens=2)


def _post(graph, body):
    req = urllib.request.Request(graph.http + "/v1/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as reply:
        return json.loads(reply.read())


def test_the_bodies_lm_eval_sends_are_answered_in_the_shape_it_reads(served):
    g, _, oracle, name = served
    ctx = ids_of(oracle, "Question: what is the colour of the sky? Answer:")
    conts = [ids_of(oracle, " blue"), ids_of(oracle, " green")]
    # loglikelihood: context + continuation, one token generated, echo, logprobs 1.
    body = {"model": name, "prompt": [ctx + c for c in conts], "temperature": 0,
            "max_tokens": 1, "logprobs": 1, "seed": 1234, "echo": True}
    out = _post(g, body)
    choices = sorted(out["choices"], key=lambda c: c["index"])
    assert [c["index"] for c in choices] == [0, 1]
    for cont, c in zip(conts, choices):
        lp = c["logprobs"]
        ids = ctx + cont
        # What lm-eval computes: the continuation's summed logprob, and whether each of its
        # tokens is the greedy one (the top_logprobs entry's key is its text).
        got = sum(lp["token_logprobs"][len(ctx):-1])
        want, best = oracle.prompt_logprobs(ids)
        assert got == pytest.approx(sum(want[len(ctx) - 1:]), abs=1e-4, rel=1e-5)
        for i in range(len(ctx), len(ids)):
            top = lp["top_logprobs"][i]
            assert isinstance(top, dict) and len(top) == 1
            assert (max(top, key=top.get) == lp["tokens"][i]) == (best[i - 1] == ids[i])
    # generate_until with --batch_size > 1: a list of string prompts, stop strings.
    body = {"prompt": ["Hello world", "One two three"], "model": name, "max_tokens": 8,
            "temperature": 0, "stop": ["\n\n"], "seed": 1234}
    out = _post(g, body)
    assert sorted(c["index"] for c in out["choices"]) == [0, 1]
    assert all(isinstance(c["text"], str) for c in out["choices"])


def test_vllms_prompt_logprobs_extra(served):
    _, api, oracle, name = served
    ids = ids_of(oracle, TEXTS[3])
    r = api.completions.create(model=name, prompt=ids, max_tokens=1, temperature=0,
                               extra_body={"prompt_logprobs": 2})
    got = r.model_extra["choices"][0]["prompt_logprobs"] if r.model_extra.get("choices") \
        else r.choices[0].model_extra["prompt_logprobs"]
    want, _ = oracle.prompt_logprobs(ids)
    assert got[0] is None and len(got) == len(ids)
    for i, entry in enumerate(got[1:], start=1):
        assert entry[str(ids[i])]["logprob"] == pytest.approx(want[i - 1], abs=1e-4, rel=1e-5)
        assert 2 <= len(entry) <= 3


def test_prompt_logprobs_on_the_zmq_api_from_a_position(served):
    """logprob_start_len=20 after the same prompt ran: a prefix hit covers at most the 19
    positions before the first one scored (the hybrid model resumes at a chunk's end)."""
    from protocol.client import Client

    g, _, oracle, _ = served
    text = TEXTS[0] + " " + TEXTS[1]
    ids = ids_of(oracle, text)
    with Client(g.address, timeout=60) as c:
        c.generate(ids, max_new_tokens=1)
        r = c.generate(ids, max_new_tokens=2, logprob_start_len=20, top_logprobs=2, echo=True)
    want, _ = oracle.prompt_logprobs(ids)
    assert 0 < r.cached_tokens <= 19
    assert r.prompt_ids == ids and r.prompt_text == text
    assert r.prompt_logprobs[:20] == [None] * 20 and r.prompt_top_ids[:20] == [[]] * 20
    np.testing.assert_allclose(r.prompt_logprobs[20:], want[19:], **TOL)
    assert all(len(t) == 2 for t in r.prompt_top_ids[20:])
    assert r.token_ids == oracle.greedy(ids, 2)


def test_several_prompts_streamed_with_echo(served):
    """Each choice's pieces carry its index; the prompt's piece comes first in each."""
    _, api, oracle, name = served
    prompts = [ids_of(oracle, t)[:10] for t in TEXTS[:3]]
    chunks = list(api.completions.create(model=name, prompt=prompts, n=2, max_tokens=3,
                                         temperature=0, echo=True, logprobs=1, stream=True,
                                         stream_options={"include_usage": True}))
    texts: dict[int, str] = {}
    for c in chunks:
        for choice in c.choices:
            if choice.index not in texts:
                assert len(choice.logprobs.token_logprobs) == 10  # the prompt's piece
            texts[choice.index] = texts.get(choice.index, "") + choice.text
    assert sorted(texts) == list(range(6))
    for p, ids in enumerate(prompts):
        want = oracle.tokenizer.decode(ids) + oracle.tokenizer.decode(oracle.greedy(ids, 3))
        assert texts[2 * p] == texts[2 * p + 1] == want
    assert chunks[-1].usage.prompt_tokens == 30 and chunks[-1].usage.completion_tokens == 18


def test_the_request_limits_of_several_prompts_are_named(served):
    _, api, _, name = served
    with pytest.raises(openai.BadRequestError, match="max_request_tokens"):
        api.completions.create(model=name, prompt=[[1000 + i for i in range(100)]] * 4,
                               max_tokens=1)
    with pytest.raises(openai.BadRequestError, match="max_request_tokens"):
        api.completions.create(model=name, prompt=["one two three four " * 40] * 2,
                               max_tokens=1)
    with pytest.raises(openai.BadRequestError, match="max_prompts"):
        api.completions.create(model=name, prompt=["a"] * 9, max_tokens=1)
    with pytest.raises(openai.BadRequestError, match="max_choices"):
        api.completions.create(model=name, prompt=["a"] * 8, n=16, max_tokens=1)
    ok = api.completions.create(model=name, prompt=["a", "b"], max_tokens=1)
    assert len(ok.choices) == 2
