"""Prometheus metrics, counted from the replies the tokenizer actor sends (ZMQ and HTTP), with
the names sglang and vLLM users know, under the `mas:` prefix."""

from __future__ import annotations

from bisect import bisect_left

from protocol import messages as m

_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
            7.5, 10.0, 20.0, 40.0, 80.0, 160.0)
_PAGE_STATES = ("total", "used", "cached", "free")  # the order of TokenBatch.kv_pages


class Histogram:
    def __init__(self):
        self.counts = [0] * (len(_BUCKETS) + 1)
        self.total = 0.0
        self.n = 0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(_BUCKETS, value)] += 1
        self.total += value
        self.n += 1

    def render(self, name: str, labels: str) -> list[str]:
        lines, running = [f"# TYPE {name} histogram"], 0
        for bound, count in zip((*_BUCKETS, float("inf")), self.counts):
            running += count
            le = "+Inf" if bound == float("inf") else repr(bound)
            lines.append(f'{name}_bucket{{{labels},le="{le}"}} {running}')
        lines += [f"{name}_sum{{{labels}}} {self.total}", f"{name}_count{{{labels}}} {self.n}"]
        return lines


class Metrics:
    def __init__(self):
        self.prompt_tokens = self.generation_tokens = self.cached_tokens = 0
        self.finished: dict[str, int] = {}
        self.ttft, self.itl, self.e2e = Histogram(), Histogram(), Histogram()
        # replica -> (running, queued) as its scheduler last reported them
        self.loads: dict[int, tuple[int, int]] = {}
        # replica -> its KV pages [total, used, cached, free] as last reported
        self.pages: dict[int, list[int]] = {}

    def scheduler_load(self, running: int, queued: int, replica: int = 0,
                       kv_pages: list[int] = ()) -> None:
        self.loads[replica] = (running, queued)
        if kv_pages:
            self.pages[replica] = list(kv_pages)

    def reply(self, reply: m.ClientWire) -> None:
        if isinstance(reply, m.Finished):
            self.prompt_tokens += reply.prompt_tokens
            self.generation_tokens += reply.completion_tokens
            self.cached_tokens += reply.cached_tokens
            self.finished[reply.finish_reason] = self.finished.get(reply.finish_reason, 0) + 1
            if reply.ttft_s:
                self.ttft.observe(reply.ttft_s)
            if reply.completion_tokens > 1:
                self.itl.observe((reply.total_s - reply.ttft_s) / (reply.completion_tokens - 1))
            self.e2e.observe(reply.total_s)
        elif isinstance(reply, m.ErrorReply):
            self.finished["error"] = self.finished.get("error", 0) + 1

    def render(self, model: str, open_requests: int, internal_errors: int = 0,
               routed: list[int] = (), running_cap: int = 0, sizing: str = "",
               page_bytes: int = 0) -> str:
        """The schedulers' last counts; zero once nothing is open (their last word may be
        old). `routed`: requests sent to each data-parallel replica (when there are several).
        `page_bytes`: one KV page's bytes on one runner rank (KV_PAGE tokens' KV)."""
        labels = f'model_name="{model}"'
        hit = self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0
        loads = self.loads if open_requests else {r: (0, 0) for r in self.loads}
        lines = [
            "# TYPE mas:num_requests_running gauge",
            f"mas:num_requests_running{{{labels}}} {sum(r for r, _ in loads.values())}",
            # scheduler.max_running_requests per replica (launch/sizing.py sized it if auto)
            "# TYPE mas:max_running_requests gauge",
            f'mas:max_running_requests{{{labels},why="{_label(sizing)}"}} {running_cap}',
            "# TYPE mas:num_requests_waiting gauge",
            f"mas:num_requests_waiting{{{labels}}} {sum(q for _, q in loads.values())}",
            "# TYPE mas:prompt_tokens_total counter",
            f"mas:prompt_tokens_total{{{labels}}} {self.prompt_tokens}",
            "# TYPE mas:generation_tokens_total counter",
            f"mas:generation_tokens_total{{{labels}}} {self.generation_tokens}",
            "# TYPE mas:prefix_cache_hit_rate gauge",
            f"mas:prefix_cache_hit_rate{{{labels}}} {hit}",
            # Requests failed by a bug of ours that the intake boundary caught (a 500 each).
            "# TYPE mas:internal_errors_total counter",
            f"mas:internal_errors_total{{{labels}}} {internal_errors}",
            "# TYPE mas:request_success_total counter",
            *[f'mas:request_success_total{{{labels},finished_reason="{r}"}} {n}'
              for r, n in sorted(self.finished.items())],
        ]
        if len(routed) > 1:  # data parallel: what each replica got and holds
            lines.append("# TYPE mas:replica_requests_total counter")
            lines += [f'mas:replica_requests_total{{{labels},replica="{r}"}} {n}'
                      for r, n in enumerate(routed)]
            lines.append("# TYPE mas:replica_requests_running gauge")
            lines += [f'mas:replica_requests_running{{{labels},replica="{r}"}} '
                      f'{loads.get(r, (0, 0))[0]}' for r in range(len(routed))]
        lines += self._render_pages(labels, page_bytes)
        lines += self.ttft.render("mas:time_to_first_token_seconds", labels)
        lines += self.itl.render("mas:inter_token_latency_seconds", labels)
        lines += self.e2e.render("mas:e2e_request_latency_seconds", labels)
        return "\n".join(lines) + "\n"

    def _render_pages(self, labels: str, page_bytes: int) -> list[str]:
        """The KV pool's pages summed over replicas, and their bytes (none reported yet: no
        lines). Kept as last reported even once nothing is open, unlike the request counts:
        memory does not empty when requests end (the prefix cache keeps their pages), so a
        zero would be wrong too. The last word may be a step old: a scheduler reports only
        with tokens or endings, and with overlap a finished request's pages go back (to the
        tree or free) when the step still carrying it returns, which sends nothing; `used`
        then counts them until the next batch."""
        if not self.pages:
            return []
        sums = [sum(col) for col in zip(*self.pages.values())]
        lines = ["# TYPE mas:kv_pages gauge"]
        lines += [f'mas:kv_pages{{{labels},state="{s}"}} {n}' for s, n in zip(_PAGE_STATES, sums)]
        lines.append("# TYPE mas:kv_pool_bytes gauge")
        lines += [f'mas:kv_pool_bytes{{{labels},state="{s}"}} {n * page_bytes}'
                  for s, n in zip(_PAGE_STATES, sums)]
        return lines


def _label(text: str) -> str:
    """A Prometheus label value: backslashes, quotes and newlines escaped."""
    return text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
