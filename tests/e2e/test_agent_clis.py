"""The real agent CLIs against the real graph: Claude Code over /v1/messages, Codex over
/v1/responses, through a recording proxy. Each answers with the text the server sent, and a
second turn of the conversation is served mostly from the prefix cache (an agent resends its
whole conversation, 10k+ tokens of it instructions and tools, every turn)."""

import pytest

from harness.agents import ClaudeSession, CodexSession, install, why_not
from harness.graph import Graph
from harness.proxy import (Exchange, RecordingProxy, anthropic_text, anthropic_usage,
                           first_difference, responses_text, responses_usage)
from models.builtin import ensure_builtin

pytestmark = pytest.mark.slow

PROMPTS = ("Say hi.", "Now say it in French.")
CACHED = 0.9  # the least share of a second turn's prompt served from the cache


@pytest.fixture(scope="module")
def agents():
    if reason := why_not():
        pytest.skip(reason)
    return install()


@pytest.fixture(scope="module")
def served(agents, model_cache):
    """The graph and a recording proxy in front of it. The model is qwen3-chat-tiny, whose
    replies end by themselves after a few tokens: both CLIs take a reply cut at a token cap
    for an error (Claude Code asks to resume, then fails; Codex fails on status incomplete).
    The cap only bounds a rare long reply's time."""
    ensure_builtin("qwen3-chat-tiny", cache_dir=model_cache, progress=False)
    g = Graph("model.builtin=qwen3-chat-tiny", "limits.max_output_tokens=1024")
    with RecordingProxy(g.http) as proxy:
        yield g, proxy
    assert g.stop() == 0


def converse(agent, proxy: RecordingProxy, path: str) -> list[tuple]:
    """Each prompt as a turn of one conversation: (Turn, the turn's exchanges on path)."""
    turns = []
    with agent:
        for prompt in PROMPTS:
            start = len(proxy.exchanges)
            turn = agent.ask(prompt)
            turns.append((turn, proxy.since(start, path)))
    return turns


@pytest.fixture(scope="module")
def claude(agents, served):
    g, proxy = served
    return converse(ClaudeSession(agents, proxy.url, g.started.model), proxy, "/v1/messages")


@pytest.fixture(scope="module")
def codex(agents, served):
    g, proxy = served
    return converse(CodexSession(agents, proxy.url, g.started.model), proxy, "/v1/responses")


def answered(turn, exchanges: list[Exchange], text) -> None:
    assert exchanges, f"the CLI sent no request (exit {turn.code}): {turn.stderr[-2000:]}"
    last = exchanges[-1]
    assert last.status == 200, f"{last.path} answered {last.status}: {last.response[:500]!r}"
    assert turn.code == 0, (f"exit {turn.code} after {len(exchanges)} requests: {turn.answer!r}"
                            f"\n{turn.stderr[-2000:]}\nthe last reply ended: "
                            f"{last.response[-400:].decode(errors='replace')}")
    assert lines(turn.answer) == lines(text(last.response))


def lines(text: str) -> list[str]:
    """The text as a terminal shows it: a CLI prints the reply line by line and drops the
    spaces that end a line (random-weight replies have some)."""
    return [line.rstrip() for line in text.strip().splitlines()]


def second_turn_cached(turns, fraction, rendered: tuple[str, ...]) -> None:
    """The second turn's first request (the one resending the conversation) is served from the
    cache; if not, say where its body first differs from the first turn's last request."""
    (_, before), (_, after) = turns
    assert before and after and after[0].status == 200
    cached, total = fraction(after[0].response)
    a, b = before[-1].request_json(), after[0].request_json()
    where = first_difference({k: a.get(k) for k in rendered}, {k: b.get(k) for k in rendered})
    assert cached >= CACHED * total, (f"{cached} of {total} prompt tokens cached; the "
                                      f"request bodies first differ at {where}")


def anthropic_cached(body: bytes) -> tuple[int, int]:
    u = anthropic_usage(body)
    cached = u.get("cache_read_input_tokens", 0)
    return cached, cached + u.get("cache_creation_input_tokens", 0) + u["input_tokens"]


def responses_cached(body: bytes) -> tuple[int, int]:
    u = responses_usage(body)
    return u.get("input_tokens_details", {}).get("cached_tokens", 0), u["input_tokens"]


@pytest.mark.parametrize("turn", [0, 1], ids=["first", "continue"])
def test_claude_answers_with_the_served_text(claude, turn):
    answered(*claude[turn], anthropic_text)


def test_claude_continue_is_served_from_the_cache(claude):
    second_turn_cached(claude, anthropic_cached, ("system", "tools", "messages"))


@pytest.mark.parametrize("turn", [0, 1], ids=["first", "resume"])
def test_codex_answers_with_the_served_text(codex, turn):
    answered(*codex[turn], responses_text)


def test_codex_resume_is_served_from_the_cache(codex):
    second_turn_cached(codex, responses_cached, ("instructions", "tools", "input"))
