"""Models named by Hugging Face repo ids through the real graph: a Hugging Face cache in a
temporary HF_HOME, in the library's real layout, offline (HF_HUB_OFFLINE=1). `org/name`
serves main with mlx-lm's greedy tokens, `org/name@rev` that revision; /v1/models and the
responses carry the repo id; a request for another model is served, or a 404 with
server.strict_model_name; an uncached id fails at launch within seconds with no actor
started; `launch --model DIR` runs without a config file."""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
import time

import openai
import pytest

from harness.graph import ROOT, READY, Graph, start_graph, stop_graph
from models.builtin import ensure_builtin
from protocol.client import AsyncClient
from harness.oracle import Oracle
from tests.support.hub import REV_MAIN, REV_OLD, cache_model

pytestmark = pytest.mark.slow

REPO = "test-org/tiny"
PROMPT = "The rivers of the north run cold"


@pytest.fixture(scope="module")
def hf_home(tmp_path_factory, model_cache):
    home = tmp_path_factory.mktemp("hf-home")
    hub_cache = home / "hub"
    cache_model(hub_cache, REPO, ensure_builtin("qwen3-tiny", model_cache, progress=False),
                REV_MAIN, main=True)
    cache_model(hub_cache, REPO, ensure_builtin("gemma3-tiny", model_cache, progress=False),
                REV_OLD, main=False)
    return {"HF_HOME": str(home), "HF_HUB_OFFLINE": "1"}, hub_cache


async def _generate(address: str, ids: list[int]) -> list[int]:
    async with AsyncClient(address) as client:
        return (await client.generate(ids, max_new_tokens=8)).token_ids


def _served_tokens(g: Graph, oracle: Oracle) -> None:
    ids = oracle.tokenizer.encode(PROMPT)
    got = asyncio.run(asyncio.wait_for(_generate(g.address, ids), 120))
    oracle.check(ids, got, oracle.greedy(ids, 8))


def test_a_repo_id_serves_main_named_by_the_repo(hf_home):
    env, hub_cache = hf_home
    g = Graph(f"model.path={REPO}", env=env)
    try:
        folder = hub_cache / "models--test-org--tiny" / "snapshots" / REV_MAIN
        _served_tokens(g, Oracle(str(folder)))
        api = openai.OpenAI(base_url=f"{g.http}/v1", api_key="none")
        assert [m.id for m in api.models.list().data] == [REPO]
        # Another model's name is served, and the response says which model answered.
        reply = api.completions.create(model="gpt-4o", prompt=PROMPT, max_tokens=3)
        assert reply.model == REPO and reply.choices[0].text
    finally:
        assert g.stop() == 0
    [start] = g.events("launch.start")
    assert start["model"] == REPO and start["revision"] == REV_MAIN
    assert start["path"] == str(folder)


def test_a_revision_serves_that_revision_and_strict_names_refuse_others(hf_home):
    env, hub_cache = hf_home
    g = Graph(f"model.path={REPO}@{REV_OLD}", "server.strict_model_name=true", env=env)
    try:
        folder = hub_cache / "models--test-org--tiny" / "snapshots" / REV_OLD
        _served_tokens(g, Oracle(str(folder)))  # gemma3-tiny's tokens, not qwen3-tiny's
        api = openai.OpenAI(base_url=f"{g.http}/v1", api_key="none")
        with pytest.raises(openai.NotFoundError) as e:
            api.completions.create(model="gpt-4o", prompt=PROMPT, max_tokens=3)
        assert e.value.body["param"] == "model" and "gpt-4o" in e.value.body["message"]
        with pytest.raises(openai.NotFoundError):
            api.chat.completions.create(model="other", max_tokens=3,
                                        messages=[{"role": "user", "content": "hi"}])
        reply = api.completions.create(model=REPO, prompt=PROMPT, max_tokens=3)
        assert reply.model == REPO  # the served name still works
    finally:
        assert g.stop() == 0
    assert g.events("launch.start")[0]["revision"] == REV_OLD


def test_an_uncached_repo_fails_at_launch_within_seconds(hf_home):
    env, hub_cache = hf_home
    lines: list[str] = []
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="did not start"):
        start_graph("model.path=test-org/absent", on_log=lines.append, ready_timeout=60, env=env)
    assert time.monotonic() - start < 30
    text = "".join(lines)
    assert "model test-org/absent is not in the Hugging Face cache" in text
    assert str(hub_cache) in text and "hf download test-org/absent" in text
    assert "actor.start" not in text and "runner" not in text  # no actor was started


def test_launch_with_a_model_directory_and_no_config_file(model_cache):
    path = ensure_builtin("qwen3-tiny", model_cache, progress=False)
    proc = subprocess.Popen([sys.executable, "-m", "launch", "--model", str(path), "--port", "0",
                             "--http-port", "0", "--set", "log.stderr=false"],
                            stdout=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        line = proc.stdout.readline()
        found = READY.search(line)
        assert found, line
        assert found.group(1) == path.name and re.search(rf"from {re.escape(str(path))}", line)
        ids = Oracle(str(path)).tokenizer.encode(PROMPT)
        assert asyncio.run(asyncio.wait_for(_generate(found.group(2), ids), 120))
    finally:
        stop_graph(proc)
    assert proc.returncode == 0


def test_launch_alone_serves_the_built_in_model(model_cache):
    from protocol.config import ModelConfig

    proc = subprocess.Popen([sys.executable, "-m", "launch", "--port", "0", "--http-port", "0",
                             "--set", "log.stderr=false"], stdout=subprocess.PIPE, text=True,
                            cwd=ROOT, env={**os.environ, "MAS_CACHE_DIR": str(model_cache)})
    try:
        found = READY.search(proc.stdout.readline())
        assert found and found.group(1) == ModelConfig().builtin
    finally:
        stop_graph(proc)
    assert proc.returncode == 0
