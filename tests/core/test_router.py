"""The tokenizer's data-parallel router: prefix affinity, load balance, groups, forgetting."""

from __future__ import annotations

from actors.tokenizer.metrics import Metrics
from actors.tokenizer.router import BLOCK, Router


def prompt(seed: int, n: int = 100) -> list[int]:
    return [(seed * 7919 + i * 31) % 50000 for i in range(n)]


def test_distinct_prompts_spread_over_the_least_loaded():
    r = Router(3)
    got = [r.route(prompt(s)).replica for s in range(6)]
    assert sorted(got) == [0, 0, 1, 1, 2, 2] and r.load == [2, 2, 2]
    r.done(got[0])
    assert r.route(prompt(99)).replica == got[0]  # the one with a free place


def test_a_shared_prefix_follows_the_replica_that_cached_it():
    r = Router(2)
    system = prompt(1, 4 * BLOCK)
    first = r.route(system + prompt(2, 20))
    r.route(prompt(3))  # the other replica is now as busy
    second = r.route(system + prompt(4, 30))
    assert second.replica == first.replica and second.reason == "prefix"
    assert second.matched == 4 * BLOCK


def test_a_short_match_does_not_count():
    r = Router(2, min_match=2 * BLOCK)
    first = r.route(prompt(1, BLOCK) + prompt(2, 40))
    second = r.route(prompt(1, BLOCK) + prompt(3, 40))  # one block in common
    assert second.reason == "load" and second.replica != first.replica


def test_a_busy_replica_loses_its_cache_hits_past_the_slack():
    r = Router(2, slack=2)
    system = prompt(5, 8 * BLOCK)
    replicas = [r.route(system + [i] * 5).replica for i in range(5)]
    # Hits while the cached replica is at most 2 busier, then the other one.
    assert replicas[:3] == [replicas[0]] * 3 and replicas[3] != replicas[0]
    assert max(r.load) - min(r.load) <= 2


def test_the_choices_of_one_group_stay_together_until_the_last_ends():
    r = Router(2)
    r.route(prompt(7))
    a = [r.route(prompt(8), group="c/g").replica for _ in range(3)]
    assert len(set(a)) == 1 and r.route(prompt(9), group="c/g").reason == "group"
    for _ in range(4):
        r.done(a[0], "c/g")
    assert "c/g" not in r.groups and r.load[a[0]] == 0


def test_the_index_forgets_its_oldest_prefixes_past_capacity():
    r = Router(2, capacity=10)
    r.route(prompt(1, 8 * BLOCK))
    for s in range(2, 5):
        r.route(prompt(s, 8 * BLOCK))
    assert len(r.index) == 10
    again = r.route(prompt(1, 8 * BLOCK))
    assert again.reason == "load"  # its blocks were dropped


def test_one_replica_routes_everything_to_it():
    r = Router(1)
    assert {r.route(prompt(s)).replica for s in range(5)} == {0} and r.routed == [5]
    assert not r.index  # nothing hashed or remembered: there is nothing to choose


def test_metrics_sum_the_replicas_and_list_each():
    metrics = Metrics()
    metrics.scheduler_load(3, 1, replica=0)
    metrics.scheduler_load(2, 4, replica=1)
    text = metrics.render("m", open_requests=5, routed=[7, 6])
    assert 'mas:num_requests_running{model_name="m"} 5' in text
    assert 'mas:num_requests_waiting{model_name="m"} 5' in text
    assert 'mas:replica_requests_total{model_name="m",replica="1"} 6' in text
    assert 'mas:replica_requests_running{model_name="m",replica="0"} 3' in text
    assert "replica=" not in Metrics().render("m", open_requests=0, routed=[4])


def test_metrics_sum_the_replicas_kv_pages_and_keep_them_when_idle():
    metrics = Metrics()
    assert "mas:kv_pages" not in metrics.render("m", open_requests=0)  # none reported yet
    metrics.scheduler_load(1, 0, replica=0, kv_pages=[100, 30, 20, 70])
    metrics.scheduler_load(0, 0, replica=1, kv_pages=[100, 5, 5, 95])
    metrics.scheduler_load(2, 0, replica=1)  # a batch without pages keeps the last ones
    page_bytes = 16 * 1024
    for open_requests in (3, 0):  # idle: the cache still holds its pages
        text = metrics.render("m", open_requests=open_requests, page_bytes=page_bytes)
        for state, pages in (("total", 200), ("used", 35), ("cached", 25), ("free", 165)):
            assert f'mas:kv_pages{{model_name="m",state="{state}"}} {pages}\n' in text
            assert (f'mas:kv_pool_bytes{{model_name="m",state="{state}"}} '
                    f'{pages * page_bytes}\n') in text
    assert text.count("# TYPE mas:kv_pages gauge") == 1


def test_a_session_stays_on_its_replica_however_busy():
    """An agent's turns go where its first turn went (its prefix cache holds the
    conversation), even past the slack that moves other cache hits elsewhere."""
    r = Router(2, slack=0)
    first = r.route(prompt(1), session="agent-a")
    r.load[first.replica] += 4  # its replica grows much busier than the other
    again = r.route(prompt(2), session="agent-a")
    assert again.replica == first.replica and again.reason == "session"
    other = r.route(prompt(3), session="agent-b")  # a new session: the least loaded
    assert other.replica != first.replica and other.reason == "load"


def test_sessions_are_forgotten_least_recently_used_first():
    r = Router(2, session_capacity=2)
    for name in ("a", "b"):
        r.route(prompt(ord(name)), session=name)
    r.route(prompt(1), session="a")  # a is now the most recent
    r.route(prompt(2), session="c")
    assert list(r.sessions) == ["a", "c"]


def test_one_replica_keeps_no_sessions():
    r = Router(1)
    assert r.route(prompt(1), session="a").replica == 0 and not r.sessions
