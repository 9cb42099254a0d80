"""Start, stop and die: the graph shuts down in order, errors open requests instead of hanging,
and leaves no process or ipc file behind."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
import urllib.error
import urllib.request

import pytest

from harness.graph import Graph
from harness.procs import children, title
from models.builtin import ensure_builtin
from protocol import messages as m
from protocol.client import AsyncClient, Client, ServerError

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tiny(model_cache):
    ensure_builtin("qwen3-tiny", cache_dir=model_cache, progress=False)
    return "model.builtin=qwen3-tiny"


def test_sigint_drains_and_exits_cleanly(tiny):
    g = Graph(tiny)
    pids = list(g.actor_pids().values())
    assert len(pids) == 4
    with Client(g.address, timeout=60) as client:
        assert client.generate("Hello", max_new_tokens=3).finish_reason == "length"
    assert g.stop(signal.SIGINT) == 0
    assert g.wait_gone(pids) == []
    assert not os.path.exists(g.ipc_dir)


def test_sigterm_lets_an_open_request_finish(tiny):
    g = Graph(tiny, "launch.drain_timeout_s=60")
    with Client(g.address, timeout=60) as client:
        stream = client.generate("Count slowly", max_new_tokens=40, ignore_eos=True, stream=True)
        next(stream)  # it is running
        g.proc.send_signal(signal.SIGTERM)
        final = [p for p in stream][-1]
    assert isinstance(final, m.Finished) and final.completion_tokens == 40
    assert g.wait() == 0


# The client's own limit: an error that came from it (a reply that never came) would take this
# long; what the tests below expect comes within a few seconds of the death.
CLIENT_TIMEOUT_S = 60
PROMPTLY_S = 15


@pytest.mark.parametrize("victim", ["runner", "scheduler", "detokenizer", "tokenizer"])
def test_a_killed_actor_errors_open_requests_and_takes_the_graph_down(tiny, victim):
    g = Graph(tiny)
    pids = g.actor_pids()
    errors: list[tuple[ServerError, float]] = []
    started = threading.Event()

    def request() -> None:
        with Client(g.address, timeout=CLIENT_TIMEOUT_S) as client:
            try:
                for _ in client.generate("Tell me everything", max_new_tokens=3000,
                                         ignore_eos=True, stream=True):
                    started.set()
            except ServerError as e:
                errors.append((e, time.monotonic()))

    worker = threading.Thread(target=request)
    worker.start()
    assert started.wait(60)
    killed = time.monotonic()
    os.kill(pids[victim], signal.SIGKILL)
    worker.join(CLIENT_TIMEOUT_S + 10)
    assert not worker.is_alive(), "the client hung"
    assert len(errors) == 1
    error, at = errors[0]
    if victim == "tokenizer":
        # The tokenizer holds the clients' socket: with it gone no error reply can come, and
        # the client library reports the dropped connection (protocol/client.py), not its
        # own timeout.
        assert error.message == "connection to the server was lost", error.message
    else:
        # The tokenizer answers the open request as the launcher stops the graph. The exit
        # status is collected before it is reported ("exit code None" before).
        assert f"actor {victim} died (killed by SIGKILL)" in error.message, error.message
        assert error.code == 503
    assert at - killed < PROMPTLY_S, f"the error took {at - killed:.1f} s"
    assert g.wait(60) != 0
    assert g.wait_gone(pids.values()) == []
    assert not os.path.exists(g.ipc_dir)


async def _open_streams(address: str, n: int, kill) -> list[tuple[object, float]]:
    """n streamed requests, each running (its first piece in), then kill(); returns each
    request's outcome (its ServerError, or what it ended with instead) and when it came."""
    async with AsyncClient(address) as client:
        streams = [await client.generate(f"Story {k}: once upon a time", max_new_tokens=3000,
                                         ignore_eos=True, stream=True) for k in range(n)]
        for stream in streams:
            await anext(stream)

        async def outcome(stream) -> tuple[object, float]:
            try:
                async for piece in stream:
                    if not isinstance(piece, str):
                        return piece, time.monotonic()
            except ServerError as e:
                return e, time.monotonic()
            return None, time.monotonic()

        kill()
        return await asyncio.wait_for(
            asyncio.gather(*map(outcome, streams)), CLIENT_TIMEOUT_S)


def test_open_requests_error_promptly_when_the_launcher_is_killed(tiny):
    """SIGKILL to the launcher while requests stream: each actor sees its parent gone
    (actors/shell.py) and exits; every open request ends at once with an error, not a hang or
    the client's own timeout, and no actor process is left behind."""
    g = Graph(tiny)
    pids = g.actor_pids()
    assert len(pids) == 4
    actors = [p for p in children(g.proc.pid) if title(p).startswith("mas-")]
    assert sorted(actors) == sorted(pids.values())
    killed: list[float] = []

    def kill() -> None:
        killed.append(time.monotonic())
        g.proc.kill()

    outcomes = asyncio.run(_open_streams(g.address, 3, kill))
    for got, at in outcomes:
        assert isinstance(got, ServerError), got
        # The tokenizer's error reply (fail_all), flushed before its process exits.
        assert (got.message, got.code) == ("server launcher died", 503), got
        assert at - killed[0] < PROMPTLY_S, f"the error took {at - killed[0]:.1f} s"
    assert g.wait(30) == -signal.SIGKILL
    assert g.wait_gone(pids.values(), timeout=30) == []
    # Each actor said why it went (their log lines reach us through the pipe they shared).
    gone = {r["actor"] for r in g.events("actor.parent_gone")}
    assert gone == set(pids), gone
    assert not os.path.exists(g.ipc_dir), os.listdir(g.ipc_dir)


def test_sigint_while_starting_stops_everything(tiny, tmp_path):
    import subprocess
    import sys
    import time

    from harness.graph import ROOT, alive

    proc = subprocess.Popen([sys.executable, "-m", "launch", "--config",
                             str(ROOT / "configs" / "qwen.toml"), "--set", tiny,
                             "--set", "server.port=0", "--set", "log.stderr=false",
                             "--set", f"log.dir={tmp_path}"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    children: list[int] = []
    deadline = time.monotonic() + 30
    while len(children) < 4 and time.monotonic() < deadline:  # spawned, still loading
        time.sleep(0.05)
        children = [int(p) for p in subprocess.run(["pgrep", "-P", str(proc.pid)],
                                                   capture_output=True, text=True).stdout.split()]
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 1 and "ready" not in out
    assert "interrupted by SIGINT" in err
    deadline = time.monotonic() + 20
    while any(alive(p) for p in children) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert children and not any(alive(p) for p in children)


def _health(url: str) -> int:
    try:
        with urllib.request.urlopen(url + "/health", timeout=60) as reply:
            return reply.status
    except urllib.error.HTTPError as e:
        return e.code


@pytest.mark.parametrize("victim", ["runner", *(pytest.param(v, marks=pytest.mark.matrix)
                                              for v in ("scheduler", "detokenizer"))])
def test_health_probes_the_whole_graph_and_a_wedged_actor_fails_it(tiny, victim):
    g = Graph(tiny, "server.health_timeout_s=2", "server.health_recent_s=1")
    try:
        # Idle since start-up: /health must prove the path with a probe request.
        time.sleep(1.5)
        assert _health(g.http) == 200
        probes = [r for r in g.events("request.received")
                  if r["req_id"].startswith("health-probe-")]
        assert probes, "an idle /health sent no probe"
        pid = g.actor_pids()[victim]
        os.kill(pid, signal.SIGSTOP)  # alive, but wedged
        try:
            time.sleep(1.5)
            assert _health(g.http) == 503
            assert g.wait_for("health.probe_timeout", timeout=5)
        finally:
            os.kill(pid, signal.SIGCONT)
        deadline = time.monotonic() + 30
        while _health(g.http) != 200 and time.monotonic() < deadline:
            time.sleep(0.5)
        assert _health(g.http) == 200
        with Client(g.address, timeout=60) as client:
            assert client.generate("Hello", max_new_tokens=3).finish_reason == "length"
        # Probes are not traffic: the request counters saw only the one real request.
        with urllib.request.urlopen(g.http + "/metrics") as reply:
            body = reply.read().decode()
        done = [line for line in body.splitlines()
                if line.startswith("mas:request_success_total")]
        assert done and sum(float(line.split()[-1]) for line in done) == 1
    finally:
        assert g.stop() == 0
