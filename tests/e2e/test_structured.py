"""Structured output through the OpenAI API, with the official `openai` client: json_schema,
json_object, regex and ebnf outputs always match, streamed or not, at concurrency 16 mixed with
unconstrained requests, whose greedy tokens stay those of mlx_lm.generate."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai
import pytest

from models.builtin import ensure_builtin
from models.tokenizer import load_tokenizer
from protocol.client import Client, ServerError
from harness.oracle import Oracle
from tests.support.schemas import SCHEMAS

pytestmark = pytest.mark.slow

MODEL = "qwen3-tiny"
MORE_SCHEMAS = SCHEMAS + [
    {"type": "object", "properties": {
        "id": {"type": "integer", "minimum": 1, "maximum": 9},
        "scores": {"type": "array", "items": {"type": "number", "minimum": 0, "maximum": 1},
                   "maxItems": 2},
        "owner": {"type": "object", "properties": {
            "name": {"type": "string", "maxLength": 6},
            "level": {"enum": ["low", "high"]}}, "required": ["name", "level"],
            "additionalProperties": False}},
     "required": ["id", "owner"], "additionalProperties": False},
]


@pytest.fixture(scope="module")
def api(graph):
    return openai.OpenAI(base_url=graph.http + "/v1", api_key="unused", max_retries=0)


def _schema_format(k):
    return {"type": "json_schema",
            "json_schema": {"name": f"s{k}", "schema": MORE_SCHEMAS[k], "strict": True}}


def _chat(api, k, stream, prompt="Describe a thing as JSON."):
    msgs = [{"role": "user", "content": prompt}]
    kw = dict(model=MODEL, messages=msgs, max_tokens=300, temperature=0,
              response_format=_schema_format(k))
    if not stream:
        r = api.chat.completions.create(**kw)
        return r.choices[0].message.content, r.choices[0].finish_reason
    chunks = list(api.chat.completions.create(**kw, stream=True))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    return text, [c.choices[0].finish_reason for c in chunks if c.choices
                  and c.choices[0].finish_reason][-1]


def _plain(graph, prompt):
    with Client(graph.address, timeout=120) as c:
        return c.generate(prompt, max_new_tokens=16).token_ids


def test_json_schema_outputs_validate_streamed_and_not_beside_plain_requests(graph, api,
                                                                             model_cache):
    """16 at once: a constrained chat per schema, streamed and not, with a sampled one, and
    plain greedy requests whose tokens must be those they get alone, mlx-lm's."""
    oracle = Oracle(str(ensure_builtin(MODEL, cache_dir=model_cache, progress=False)))
    plain = ["The capital of France is", "def fib(n):", "Once upon a time", "1, 2, 3,",
             "Hello world", "中文的自然语言处理", "The quick brown fox", "import numpy as np"]
    alone = {p: _plain(graph, p) for p in plain}
    for p, got in alone.items():
        ids = oracle.tokenizer.encode(p)
        oracle.check(ids, got, oracle.greedy(ids, 16))
    jobs = []
    with ThreadPoolExecutor(16) as pool:
        for k in range(len(MORE_SCHEMAS)):
            for stream in (False, True):
                jobs.append(("schema", k, pool.submit(_chat, api, k, stream)))
        jobs.append(("sampled", 0, pool.submit(
            lambda: api.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "JSON please"}],
                max_tokens=300, temperature=0.9, seed=7,
                response_format=_schema_format(0)).choices[0].message.content)))
        for p in plain:
            jobs.append(("plain", p, pool.submit(_plain, graph, p)))
        for kind, what, job in jobs:
            got = job.result()
            if kind == "schema":
                text, reason = got
                assert reason == "stop", (what, text)
                jsonschema.validate(json.loads(text), MORE_SCHEMAS[what])
            elif kind == "sampled":
                jsonschema.validate(json.loads(got), MORE_SCHEMAS[0])
            else:
                assert got == alone[what], what


def test_json_object_regex_and_ebnf_on_both_endpoints(api, model_cache):
    # A random model writes strings that never end: a bias on the closing quote and brace
    # (which the grammar allows only where JSON may have them) ends them.
    tok = load_tokenizer(str(ensure_builtin(MODEL, cache_dir=model_cache, progress=False)))
    bias = {str(t): 30 for t in tok.encode('"') + tok.encode("}") + tok.encode('"}')}
    r = api.completions.create(model=MODEL, prompt="A JSON object:", max_tokens=400,
                               temperature=0, logit_bias=bias,
                               extra_body={"response_format": {"type": "json_object"}})
    assert r.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(r.choices[0].text), dict)
    date = r"20[0-9]{2}-(0[1-9]|1[0-2])-[0-3][0-9]"
    r = api.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "When?"}],
                                    max_tokens=20, temperature=0, extra_body={"regex": date})
    assert re.fullmatch(date, r.choices[0].message.content)
    r = api.completions.create(model=MODEL, prompt="Answer:", max_tokens=20, temperature=0,
                               extra_body={"ebnf": 'root ::= ("yes" | "no") "!"'})
    assert r.choices[0].text in ("yes!", "no!")


def test_a_schema_the_library_refuses_is_a_400_naming_it_and_the_server_keeps_serving(api):
    bad = {"type": "json_schema", "json_schema": {"name": "bad", "schema": {
        "type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}}}
    with pytest.raises(openai.BadRequestError, match="json_schema"):
        api.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                    max_tokens=8, response_format=bad)
    with pytest.raises(openai.BadRequestError, match="response_format"):
        api.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                    max_tokens=8, response_format={"type": "yaml"})
    ok = api.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                     max_tokens=4, temperature=0)
    assert ok.choices[0].finish_reason in ("stop", "length")


def test_the_zmq_api_takes_the_same_constraints(graph):
    with Client(graph.address, timeout=120) as c:
        r = c.generate("An object:", max_new_tokens=300, json_schema=json.dumps(SCHEMAS[1]))
        jsonschema.validate(json.loads(r.text), SCHEMAS[1])
        pieces = list(c.generate("A date:", max_new_tokens=20, regex=r"[0-9]{4}", stream=True))
        assert re.fullmatch(r"[0-9]{4}", pieces[-1].text)
        with pytest.raises(ServerError, match="regex") as e:
            c.generate("x", regex="(unclosed")
        assert e.value.code == 400
        with pytest.raises(ServerError, match="at most one"):
            c.generate("x", regex="a", ebnf='start: "a"')


def test_constraints_with_n_choices_seeds_logprobs_and_stop_strings(api):
    fmt = _schema_format(1)
    r = api.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Go"}],
                                    max_tokens=300, temperature=1.0, seed=3, n=3,
                                    logprobs=True, top_logprobs=2, response_format=fmt)
    again = api.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Go"}],
                                        max_tokens=300, temperature=1.0, seed=3, n=3,
                                        logprobs=True, top_logprobs=2, response_format=fmt)
    for c, d in zip(r.choices, again.choices):
        jsonschema.validate(json.loads(c.message.content), MORE_SCHEMAS[1])
        assert c.message.content == d.message.content  # seeded: the same choices again
        assert c.logprobs.content and all(len(t.top_logprobs) == 2 for t in c.logprobs.content)
        # The logprob entries' tokens spell the reply (the EOS that ended it aside).
        assert "".join(t.token for t in c.logprobs.content).startswith(c.message.content)
    # A stop string cuts a constrained reply like any other (the text up to it).
    whole = r.choices[0].message.content
    cut = api.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Go"}],
                                      max_tokens=300, temperature=1.0, seed=3,
                                      response_format=fmt, stop=['"point"'])
    assert cut.choices[0].finish_reason == "stop"
    assert whole.startswith(cut.choices[0].message.content)
    assert '"point"' not in cut.choices[0].message.content
