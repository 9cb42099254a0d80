"""The soak half of the fuzz job (tools/fuzz/job.py): valid requests of every shape at a
steady concurrency, over both APIs, with clients that abort, drop the HTTP connection mid-way
or close their ZMQ socket mid-request; and the greedy canary whose tokens must never change.

Every request must end exactly once: ZMQ with one Finished or ErrorReply (none after it), HTTP
with a complete response or a stream ending in [DONE]; or the client itself left. Requests are
drawn from a seeded random.Random, so a run can be repeated.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass, field
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from tools.fuzz.clients import Tally, dealer
from benchmarks.raw_http import HttpStream, http_call, http_open, http_send
from protocol import messages as m

_replies = msgspec.msgpack.Decoder(m.ClientOutbound)
_encode = msgspec.msgpack.Encoder().encode
WORDS = ("the river stone light morning over quiet field under bright house window market "
         "garden story silver winter north road paper music letter forest ocean 世界 ñandú "
         "Straße 🎉 λόγος 東京 🙂 ÿ").split()
STOPS = [" the", "e", ".", "\n", " river", "ing", "🎉"]
TEXT_IDS = 151_643  # Qwen's text tokens: every id below is a real token
# The first requests carry the longest prompts: the warm-up then meets the largest shapes and
# fills the KV pool, so the runner's RSS after it is the steady state the band is measured from.
LONGEST_FIRST = 32
CANARY_PROMPT = "The canary sings the same song every time: one, two, three,"
CANARY_TOKENS = 16


@dataclass
class Spec:
    """One soak request: which API, shape and client behaviour."""

    index: int
    api: str  # zmq | http
    stream: bool
    action: str  # finish | abort | leave
    max_new: int
    fields: dict[str, Any]  # GenerateRequest fields (zmq) or the body (http)
    path: str = ""
    n: int = 1
    act_at: int = 1  # stream: act after this many deltas; else after act_at * 10 ms

    @property
    def kind(self) -> str:
        return f"{self.api}{'-stream' if self.stream else ''}{'-n' if self.n > 1 else ''}" \
               f"{'' if self.action == 'finish' else '-' + self.action}"

    @property
    def exact(self) -> bool:
        """ignore_eos and nothing that stops early: exactly max_new tokens per choice."""
        f = self.fields
        return bool(f.get("ignore_eos")) and not f.get("stop") and not f.get("stop_token_ids")


def _prompt(rng: random.Random, longest: bool) -> dict[str, Any]:
    words = rng.randint(800, 900) if longest else rng.choice(
        [rng.randint(1, 40), rng.randint(1, 200), rng.randint(300, 900)])
    text = " ".join(rng.choice(WORDS) for _ in range(words))
    shape = rng.choice(["prompt", "ids", "messages"])
    if shape == "ids":
        return {"input_ids": [rng.randrange(TEXT_IDS) for _ in range(words)]}
    if shape == "messages":
        msgs = [{"role": "user", "content": text}]
        if rng.random() < 0.3:
            msgs.insert(0, {"role": "system", "content": "Answer briefly."})
        return {"messages": msgs}
    return {"prompt": text}


def _sampling(rng: random.Random, max_new: int) -> dict[str, Any]:
    """Sampling fields, each present with some probability (GenerateRequest names)."""
    p: dict[str, Any] = {}
    choices = {
        "temperature": [0.0, 0.3, 0.7, 1.0, 1.5], "top_p": [0.5, 0.9, 1.0], "top_k": [0, 1, 5, 50],
        "min_p": [0.0, 0.05, 0.2], "repetition_penalty": [1.0, 1.1, 1.5],
        "frequency_penalty": [-1.0, 0.5, 1.5], "presence_penalty": [-0.5, 0.0, 1.0],
        "ignore_eos": [True, False]}
    for name, values in choices.items():
        if rng.random() < 0.3:
            p[name] = rng.choice(values)
    if rng.random() < 0.3:
        p["seed"] = rng.randrange(2**31)
    if rng.random() < 0.2:
        p["logit_bias"] = {rng.randrange(TEXT_IDS): rng.uniform(-100, 100)
                           for _ in range(rng.randint(1, 5))}
    if rng.random() < 0.2:
        p["logprobs"] = True
        p["top_logprobs"] = rng.randint(0, 5)
    if rng.random() < 0.2:
        p["stop"] = rng.sample(STOPS, rng.randint(1, 3))
    if rng.random() < 0.15:
        p["stop_token_ids"] = [rng.randrange(TEXT_IDS) for _ in range(rng.randint(1, 3))]
    if rng.random() < 0.15:
        p["min_new_tokens"] = rng.randint(0, max_new)
    return p


def _http_body(rng: random.Random, fields: dict, max_new: int, stream: bool,
               n: int) -> tuple[str, dict]:
    """The same request as an OpenAI body (completions unless it has messages)."""
    body = {k: v for k, v in fields.items() if k not in (
        "input_ids", "min_new_tokens", "logprobs", "top_logprobs", "logit_bias")}
    chat = "messages" in fields
    if "input_ids" in fields:
        body["prompt"] = fields["input_ids"]
    if "logit_bias" in fields:
        body["logit_bias"] = {str(k): v for k, v in fields["logit_bias"].items()}
    if "min_new_tokens" in fields:
        body["min_tokens"] = fields["min_new_tokens"]
    if fields.get("logprobs"):
        if chat:
            body.update(logprobs=True, top_logprobs=fields["top_logprobs"])
        else:
            body["logprobs"] = fields["top_logprobs"]
    body.update(model="soak", max_tokens=max_new, stream=stream, n=n)
    body.setdefault("temperature", 0.0)  # OpenAI's default is 1.0; ours is greedy
    if stream and rng.random() < 0.5:
        body["stream_options"] = {"include_usage": True}
    return ("/v1/chat/completions" if chat else "/v1/completions"), body


def make_spec(index: int, seed: int) -> Spec:
    rng = random.Random(seed * 1_000_003 + index)
    api = rng.choice(["zmq", "http"])
    max_new = rng.randint(1, 24)
    fields = {**_prompt(rng, index < LONGEST_FIRST), **_sampling(rng, max_new)}
    stream = rng.random() < 0.5
    action = rng.choices(["finish", "abort", "leave"], [70, 15, 15])[0]
    if api == "http":
        action = "leave" if action != "finish" else action  # HTTP has no abort but leaving
        n = rng.choice([1, 1, 1, 2, 3])
        path, body = _http_body(rng, fields, max_new, stream, n)
        return Spec(index, api, stream, action, max_new, body, path, n, rng.randint(1, 4))
    return Spec(index, api, stream, action, max_new, fields, act_at=rng.randint(1, 4))


@dataclass
class Client:
    """A soak worker's ZMQ connection (new after it left one mid-request)."""

    ctx: zmq.asyncio.Context
    address: str
    sock: zmq.asyncio.Socket | None = None
    answered: set[str] = field(default_factory=set)

    def get(self) -> zmq.asyncio.Socket:
        if self.sock is None:
            self.sock, self.answered = dealer(self.ctx, self.address), set()
        return self.sock

    def leave(self) -> None:
        """Close mid-request, as a client that crashed would: nothing more is sent."""
        if self.sock is not None:
            self.sock.close(linger=0)
        self.sock = None


async def zmq_request(client: Client, spec: Spec, tally: Tally, timeout: float) -> None:
    sock, rid = client.get(), f"soak-{spec.index}"
    await sock.send(_encode(m.GenerateRequest(req_id=rid, stream=spec.stream,
                                              max_new_tokens=spec.max_new, **spec.fields)))
    deltas, acted, start = 0, spec.action == "finish", time.monotonic()
    deadline = start + timeout
    while (left := deadline - time.monotonic()) > 0:
        if not acted and (deltas >= spec.act_at if spec.stream
                          else time.monotonic() - start >= spec.act_at * 0.01):
            acted = True
            if spec.action == "leave":
                client.leave()
                tally.outcome(spec.kind, "client_left")
                return
            await sock.send(_encode(m.AbortRequest(req_id=rid)))
            tally.outcome(spec.kind, "abort_sent")
        wait = left if acted or spec.stream else 0.01
        if not await sock.poll(wait * 1000):
            continue
        reply = _replies.decode(await sock.recv())
        if reply.req_id != rid:
            _stray(client, reply, tally, spec)
        elif isinstance(reply, m.Delta):
            deltas += 1
        else:
            client.answered.add(rid)
            _check_zmq(reply, spec, tally, aborted=spec.action == "abort")
            return
    tally.fail("soak_no_terminal", f"no terminal reply in {timeout} s: {spec}")
    tally.outcome(spec.kind, "timeout")


def _stray(client: Client, reply: Any, tally: Tally, spec: Spec) -> None:
    what = "after its terminal reply" if reply.req_id in client.answered else "of no request"
    tally.fail("soak_duplicate_reply", f"{type(reply).__name__} for {reply.req_id!r} {what}, "
               f"while waiting for soak-{spec.index}: {reply!r:.300}")


def _check_zmq(reply: Any, spec: Spec, tally: Tally, aborted: bool) -> None:
    if isinstance(reply, m.ErrorReply):
        tally.outcome(spec.kind, f"ErrorReply:{reply.code}")
        tally.fail("soak_error", f"ErrorReply({reply.code}, {reply.message!r:.200}): {spec}")
        return
    tally.outcome(spec.kind, f"Finished:{reply.finish_reason}")
    if not aborted and reply.finish_reason == "abort":
        tally.fail("soak_unasked_abort", f"finish_reason 'abort' though the client never "
                   f"aborted nor left: {spec}")
        return
    problems = []
    if len(reply.token_ids) != reply.completion_tokens or reply.completion_tokens > spec.max_new:
        problems.append(f"{reply.completion_tokens} tokens, {len(reply.token_ids)} ids, "
                        f"max {spec.max_new}")
    if not aborted and reply.finish_reason not in ("stop", "length"):
        problems.append(f"finish_reason {reply.finish_reason!r}")
    if not aborted and spec.exact and reply.completion_tokens != spec.max_new:
        problems.append(f"ignore_eos, no stops: {reply.completion_tokens} of {spec.max_new}")
    if spec.fields.get("logprobs") and not aborted and len(reply.logprobs) != len(reply.token_ids):
        problems.append(f"{len(reply.logprobs)} logprobs for {len(reply.token_ids)} tokens")
    if problems:
        tally.fail("soak_wrong_result", f"{'; '.join(problems)}: {spec}")


async def http_request(base: str, spec: Spec, tally: Tally, timeout: float) -> None:
    data = json.dumps(spec.fields).encode()
    try:
        async with asyncio.timeout(timeout):
            if spec.stream:
                await _http_stream(base, spec, data, tally)
            elif spec.action == "leave":  # gone before the reply (or while it is sent)
                _, writer = await http_send(base, spec.path, data)
                await asyncio.sleep(spec.act_at * 0.02)
                writer.close()
                tally.outcome(spec.kind, "client_left")
            else:
                status, body = await http_call(base, spec.path, data, timeout)
                _check_http(status, body, spec, tally)
    except TimeoutError:
        tally.fail("soak_no_terminal", f"no complete HTTP reply in {timeout} s: {spec}")
        tally.outcome(spec.kind, "timeout")
    except (ConnectionError, OSError, asyncio.IncompleteReadError) as e:
        tally.fail("soak_connection", f"{type(e).__name__}: {e}: {spec}")
        tally.outcome(spec.kind, "conn_error")


async def _http_stream(base: str, spec: Spec, data: bytes, tally: Tally) -> None:
    stream: HttpStream = await http_open(base, spec.path, data)
    try:
        if stream.status != 200:
            body = b"".join([p async for p in stream.pieces()])
            _check_http(stream.status, body, spec, tally)
            return
        chunks, finishes, done = 0, 0, False
        async for event in stream.events():
            if event == b"[DONE]":
                done = True
                break
            chunk = json.loads(event)
            if "error" in chunk:
                tally.fail("soak_error", f"error event {chunk['error']!r:.200}: {spec}")
            chunks += 1
            finishes += sum(1 for c in chunk.get("choices", []) if c.get("finish_reason"))
            if spec.action == "leave" and chunks >= spec.act_at:
                tally.outcome(spec.kind, "client_left")
                return
        tally.outcome(spec.kind, "done" if done else "no_done")
        if not done or finishes != spec.n:
            tally.fail("soak_stream_end", f"[DONE] {done}, {finishes} of {spec.n} choices "
                       f"finished: {spec}")
    finally:
        stream.close()


def _check_http(status: int, body: bytes, spec: Spec, tally: Tally) -> None:
    tally.outcome(spec.kind, str(status))
    if status != 200:
        tally.fail("soak_error", f"HTTP {status} {body[:200]!r}: {spec}")
        return
    reply = json.loads(body)
    reasons = [c.get("finish_reason") for c in reply.get("choices", [])]
    used = reply.get("usage", {}).get("completion_tokens", -1)
    problems = []
    if len(reasons) != spec.n or any(r not in ("stop", "length") for r in reasons):
        problems.append(f"choices' finish reasons {reasons}")
    if not 0 <= used <= spec.n * spec.max_new or (spec.exact and used != spec.n * spec.max_new):
        problems.append(f"completion_tokens {used} for n={spec.n} x {spec.max_new}")
    if problems:
        tally.fail("soak_wrong_result", f"{'; '.join(problems)}: {spec}")


async def soak(address: str, base: str, indices: range, seed: int, concurrency: int,
               tally: Tally, timeout: float) -> None:
    """`concurrency` workers take the requests in order (closed loop)."""
    ctx = zmq.asyncio.Context()
    queue = iter(indices)

    async def worker() -> None:
        client = Client(ctx, address)
        try:
            for index in queue:
                spec = make_spec(index, seed)
                tally.cases += 1
                if spec.api == "zmq":
                    await zmq_request(client, spec, tally, timeout)
                else:
                    await http_request(base, spec, tally, timeout)
        finally:
            client.leave()

    try:
        await asyncio.gather(*(worker() for _ in range(concurrency)))
    finally:
        ctx.term()


async def canary(address: str, index: int, timeout: float = 60.0) -> list[int] | str:
    """The greedy canary's token ids, or what went wrong."""
    ctx = zmq.asyncio.Context()
    sock = dealer(ctx, address)
    try:
        await sock.send(_encode(m.GenerateRequest(
            req_id=f"canary-{index}", prompt=CANARY_PROMPT, max_new_tokens=CANARY_TOKENS,
            temperature=0.0, ignore_eos=True)))
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0 and await sock.poll(left * 1000):
            reply = _replies.decode(await sock.recv())
            if isinstance(reply, m.Finished):
                return list(reply.token_ids)
            if isinstance(reply, m.ErrorReply):
                return f"ErrorReply({reply.code}, {reply.message!r})"
        return f"no reply in {timeout} s"
    finally:
        sock.close(linger=0)
        ctx.term()
