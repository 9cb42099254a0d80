"""Admission order with the prefix cache on: FIFO, except that a queued prompt the cache
mostly holds (an agent's next turn) goes before long prompts queued and running ahead of it,
a bounded number of times per head of the queue."""

import pytest

from protocol import messages as m
from actors.scheduler import core
from actors.scheduler.core import Scheduler
from actors.scheduler.request import Phase
from tests.support.driver import Driver, Scripted

P = m.SamplingParams
TURN = list(range(1, 301))  # an agent's first prompt (300 tokens: 5 chunks of 64)


def make(chunk=64):
    return Scheduler(max_running=8, context_length=4096, eos_ids=[99], chunked_prefill_size=chunk,
                     kv_slots=8192, prefix_cache=True)


def served_first_turn(s) -> Driver:
    """The first turn run to its end. The driver answers every sampled row with 7; every
    request asks for one token, so it finishes with its prefill, and `list(d.finished)` is
    the order they finished in."""
    d = Driver(s, Scripted(s, default=7))
    d.add("turn-1", TURN, P(max_new_tokens=1))
    d.run()
    return d


def test_a_cached_turn_finishes_before_long_prompts_queued_ahead_of_it():
    s = make()
    d = served_first_turn(s)
    d.add("long-a", list(range(1000, 1300)), P(max_new_tokens=1))
    d.add("long-b", list(range(2000, 2300)), P(max_new_tokens=1))
    d.add("turn-2", TURN + [5, 6, 7], P(max_new_tokens=1))
    first = d.step()
    # The turn's 3 uncached tokens (after its 300 cached) and the head's first chunk share
    # the step's budget; the turn has its token at once.
    assert sorted(zip(first.start_pos, first.input_lens)) == [(0, 61), (300, 3)]
    assert list(d.finished) == ["turn-1", "turn-2"]
    assert s.requests["long-b"].phase is Phase.QUEUED
    d.run()
    assert list(d.finished) == ["turn-1", "turn-2", "long-a", "long-b"]


def test_a_turn_mostly_not_cached_waits_its_turn():
    s = make()
    d = served_first_turn(s)
    d.add("long-a", list(range(1000, 1300)), P(max_new_tokens=1))
    d.add("other", TURN[:20] + list(range(3000, 3040)), P(max_new_tokens=1))  # 20 of 60 cached
    d.run()
    assert list(d.finished) == ["turn-1", "long-a", "other"]


def test_the_head_is_passed_a_bounded_number_of_times(monkeypatch):
    monkeypatch.setattr(core, "MAX_OVERTAKES", 1)
    s = make()
    d = served_first_turn(s)
    d.add("long-a", list(range(1000, 1300)), P(max_new_tokens=1))
    d.add("turn-2", TURN + [5], P(max_new_tokens=1))
    d.add("turn-3", TURN + [6], P(max_new_tokens=1))
    d.step()
    # turn-2 passed long-a; turn-3 may not pass it too, and long-a is admitted after them.
    assert list(d.finished) == ["turn-1", "turn-2"]
    assert s.requests["turn-3"].phase is Phase.QUEUED
    assert s.requests["long-a"].phase is Phase.RUNNING


@pytest.mark.parametrize("switch", [{"prefix_cache": False},
                                    {"prefix_cache": True, "cached_first": False}])
def test_without_the_prefix_cache_or_the_rule_admission_is_fifo(switch):
    s = Scheduler(max_running=8, context_length=4096, eos_ids=[99], chunked_prefill_size=64,
                  kv_slots=8192, **switch)
    d = served_first_turn(s)
    d.add("long-a", list(range(1000, 1300)), P(max_new_tokens=1))
    d.add("turn-2", TURN + [5, 6, 7], P(max_new_tokens=1))
    d.run()
    assert list(d.finished) == ["turn-1", "long-a", "turn-2"]
