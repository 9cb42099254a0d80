"""The load side of the benchmark: deterministic prompts of exact token lengths, and a closed-loop
streaming client that records, per request, when it was sent and when each chunk arrived.

Both servers get the same prompts through the same OpenAI streaming endpoint
(/v1/completions) with the same client, so client costs are the same for both: the official
`openai` client, or (client="lean") lean_client.py's, which takes a third of its CPU.
"""

from __future__ import annotations

import asyncio
import gc
import random
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import openai

from benchmarks.serving.lean_client import stream_completion


class PromptMaker:
    """Text whose token count is known exactly: a run of words that are each one token with
    their leading space (" river"), so the text tokenizes back to the same ids."""

    def __init__(self, tokenizer: Any):
        words = []
        for tid in range(1000, 60000):
            text = tokenizer.decode([tid])
            if (len(text) > 3 and text[0] == " " and text[1:].isascii() and text[1:].isalpha()
                    and tokenizer.encode(text) == [tid]):
                words.append(text)
        self.words = words
        self.tokenizer = tokenizer

    def make(self, n: int, seed: int) -> str:
        rng = random.Random(seed)
        text = "".join(rng.choice(self.words) for _ in range(n))
        count = len(self.tokenizer.encode(text))
        if count != n:  # never seen; a wrong length would make every figure wrong
            raise AssertionError(f"prompt meant to be {n} tokens is {count}")
        return text


@dataclass
class Sample:
    """One request as the client saw it."""

    sent: float
    chunks: list[float] = field(default_factory=list)  # arrival time of each content chunk
    tokens: int = 0  # completion tokens, from the usage chunk (else the chunk count)
    error: str = ""
    prompt_tokens: int = 0  # from the usage chunk
    cached_tokens: int = 0  # prompt tokens the server took from its prefix cache
    ended: float = float("nan")  # when the stream ended

    @property
    def ttft(self) -> float:
        return self.chunks[0] - self.sent if self.chunks else float("nan")

    @property
    def gaps(self) -> list[float]:
        return [b - a for a, b in zip(self.chunks, self.chunks[1:])]


@dataclass
class Target:
    """A server to drive: its base URL, model name, and the extra body fields that make it
    generate exactly max_tokens (ignore_eos where supported, else a logit bias on EOS)."""

    name: str
    base_url: str
    model: str
    extra: dict[str, Any]
    pid: int = 0  # the server's process (our launcher), where the benchmark reads its actors

    def client(self) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=self.base_url, api_key="bench", max_retries=0,
                                  timeout=1800)


async def one(client: openai.AsyncOpenAI, target: Target, prompt: str, max_tokens: int,
              first: Callable[[], None] = lambda: None) -> Sample:
    """One streamed request; `first` is called when its first content chunk arrives."""
    sample = Sample(sent=time.perf_counter())

    async def run() -> None:
        stream = await client.completions.create(
            model=target.model, prompt=prompt, max_tokens=max_tokens, temperature=0.0,
            stream=True, stream_options={"include_usage": True}, extra_body=target.extra)
        async for chunk in stream:
            now = time.perf_counter()
            if chunk.choices and chunk.choices[0].text:
                _content(sample, now, first)
            if usage := getattr(chunk, "usage", None):
                details = getattr(usage, "prompt_tokens_details", None)
                sample.tokens, sample.prompt_tokens = usage.completion_tokens, usage.prompt_tokens
                sample.cached_tokens = (details.cached_tokens or 0) if details else 0

    return await _recorded(sample, run())


async def one_lean(target: Target, prompt: str, max_tokens: int,
                   first: Callable[[], None] = lambda: None) -> Sample:
    """one(), through lean_client.py: the same request, the same record."""
    sample = Sample(sent=time.perf_counter())

    def on_event(event: dict[str, Any], now: float) -> None:
        choices = event.get("choices")
        if choices and choices[0].get("text"):
            _content(sample, now, first)
        if usage := event.get("usage"):
            details = usage.get("prompt_tokens_details") or {}
            sample.tokens, sample.prompt_tokens = (usage["completion_tokens"],
                                                   usage["prompt_tokens"])
            sample.cached_tokens = details.get("cached_tokens") or 0

    body = {"model": target.model, "prompt": prompt, "max_tokens": max_tokens,
            "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True},
            **target.extra}
    return await _recorded(sample, stream_completion(target.base_url, body, on_event))


def _content(sample: Sample, now: float, first: Callable[[], None]) -> None:
    sample.chunks.append(now)
    if len(sample.chunks) == 1:
        first()


async def _recorded(sample: Sample, streaming: Any) -> Sample:
    """Await the request's streaming into `sample`; its error recorded, its end stamped."""
    try:
        await streaming
    except Exception as e:  # recorded, reported, never hidden
        sample.error = repr(e)
    sample.ended = time.perf_counter()
    if not sample.tokens:
        sample.tokens = len(sample.chunks)
    return sample


async def closed_loop(target: Target, prompts: list[str], concurrency: int, max_tokens: int,
                      done: Callable[[], None] = lambda: None,
                      worker_target: Callable[[int], Target] | None = None,
                      client_kind: str = "openai") -> tuple[list[Sample], float]:
    """`concurrency` workers take the prompts in order, each sending its next request when the
    last one ends. Returns the samples (prompt order) and the wall time of the whole run.
    worker_target(w): what worker w sends (its extra body fields), if not `target`.
    client_kind: "openai" (the official client) or "lean" (lean_client.py)."""
    if client_kind not in ("openai", "lean"):
        raise ValueError(f"client_kind is 'openai' or 'lean', not {client_kind!r}")
    client = target.client() if client_kind == "openai" else None
    samples: list[Sample | None] = [None] * len(prompts)
    queue = iter(range(len(prompts)))

    async def worker(w: int) -> None:
        sends = target if worker_target is None else worker_target(w)
        for k in queue:
            if client_kind == "lean":
                samples[k] = await one_lean(sends, prompts[k], max_tokens)
            else:
                samples[k] = await one(client, sends, prompts[k], max_tokens)
            done()

    # The client's own cyclic garbage (an event loop, an openai client, httpx and pydantic
    # objects per run) made a 10-20 ms collection land inside about one request in ten:
    # latency of this process, not of the server. Collected before and after, never during.
    gc.collect()
    gc.disable()
    try:
        start = time.perf_counter()
        await asyncio.gather(*[worker(w) for w in range(concurrency)])
        wall = time.perf_counter() - start
    finally:
        gc.enable()
    if client is not None:
        await client.close()
    gc.collect()
    return samples, wall


def pct(values: list[float], q: float) -> float:
    """The q-th percentile (0-100), linear between order statistics; nan when empty."""
    values = sorted(v for v in values if v == v)
    if not values:
        return float("nan")
    pos = (len(values) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(values) - 1)
    return values[lo] + (values[hi] - values[lo]) * (pos - lo)


def steady_decode_rate(wave: list[Sample]) -> float:
    """Tokens/s while every request of a wave (sent together) is decoding: from the last of
    their first tokens to the first of their last tokens, chunks counted across them.
    This is the served counterpart of a bare forward loop at that batch size."""
    start = max(s.chunks[0] for s in wave)
    end = min(s.chunks[-1] for s in wave)
    if end - start <= 0:
        return float("nan")
    inside = sum(1 for s in wave for t in s.chunks if start < t <= end)
    return inside / (end - start)


def summarize(samples: list[Sample], wall: float, concurrency: int) -> dict[str, Any]:
    ok = [s for s in samples if not s.error and s.chunks]
    gaps = [g for s in ok for g in s.gaps]
    # Requests of one length sent together end together, so each wave of `concurrency`
    # requests decodes together: the median over waves is steadier than one wave.
    waves = [samples[k:k + concurrency] for k in range(0, len(samples), concurrency)]
    rates = [steady_decode_rate(w) for w in waves
             if len(w) == concurrency and all(not s.error and s.chunks for s in w)]
    return {
        "concurrency": concurrency, "requests": len(samples), "errors": len(samples) - len(ok),
        "first_error": next((s.error for s in samples if s.error), ""),
        "output_tokens": sum(s.tokens for s in ok), "wall_s": wall,
        "output_tok_s": sum(s.tokens for s in ok) / wall if wall else float("nan"),
        "decode_tok_s": statistics.median(rates) if rates else float("nan"),
        "ttft_p50_s": pct([s.ttft for s in ok], 50), "ttft_p99_s": pct([s.ttft for s in ok], 99),
        "itl_p50_s": pct(gaps, 50), "itl_p99_s": pct(gaps, 99),
        "itl_max_s": max(gaps) if gaps else float("nan"),
        "tokens_per_request": statistics.median([s.tokens for s in ok]) if ok else 0,
    }
