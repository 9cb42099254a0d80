"""The tokenizer actor's pure core: validate and tokenize client requests, assign rids, and turn
TextBatches into replies for the client that asked. No sockets; time is passed in.

Every request that gets an rid gets exactly one terminal reply (Finished or ErrorReply); every
request refused before that gets one ErrorReply at once. A request gets its rid only once it is
decoded, checked, tokenized and encoded for the scheduler: nothing that can still fail comes
after it. No client input may raise out of `on_client` or `submit`: a bug it finds fails that
request alone (500, counted in /metrics as an internal error) and the actor keeps serving.

A request with a constraint waits for its grammar (compiles.py) between its checks and its rid:
`submit` starts the compile and returns nothing; `compiled`, called by the shell when `wake`
says a compile ended or when `next_deadline` passes, opens the request or refuses it.
"""

from __future__ import annotations

import hmac
import itertools
import os
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Callable

import msgspec
import structlog

from actors.constraints import GrammarError
from actors.tokenizer.compiles import Compiles
from models.info import ModelInfo
from actors.tokenizer.intake import RequestError, check_request, decode_frame
from actors.tokenizer.router import Router
from protocol import messages as m
from protocol.codec import encode, pack_ids, split_counts, unpack_ids
from protocol.config import LimitsConfig

Reply = tuple[bytes, m.ClientWire]  # (client identity, message)
Outbound = tuple[int, bytes]  # (replica, encoded message for that replica's scheduler)


@dataclass
class Open:
    rid: str
    identity: bytes
    req_id: str
    stream: bool
    prompt_tokens: int
    received: float
    replica: int = 0  # the data-parallel replica running it (router.py)
    group: str = ""
    first_token: float = 0.0
    texts: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_ids: list[list[int]] = field(default_factory=list)
    top_logprobs: list[list[float]] = field(default_factory=list)
    # echo / prompt logprobs: the Delta or Finished fields that give the prompt back, once
    # (Delta.prompt_ids ...); `scoring` until the prompt's scores are in.
    prompt: dict[str, Any] | None = None
    scoring: bool = False


@dataclass
class Compiling:
    """A checked, tokenized request whose grammar is compiling; no rid yet."""

    identity: bytes
    req: m.GenerateRequest
    received: float
    peer: str
    ids: list[int]
    kind: str
    job: Future
    deadline: float
    aborted: str = ""  # the log event of an abort that came while it compiled


class Frontend:
    def __init__(self, tokenizer: Any, model: ModelInfo, log: Any = None,
                 limits: LimitsConfig = LimitsConfig(), api_key: str = "",
                 router: Router | None = None):
        self.tokenizer, self.model, self.limits = tokenizer, model, limits
        self.router = router or Router(1)
        self.api_key = api_key.encode()  # ZMQ requests must carry it (HTTP checks a header)
        self.internal_errors = 0  # requests failed by a bug of ours (/metrics)
        self.log = log or structlog.get_logger()
        self.last_progress = 0.0  # when the last TextBatch arrived (health)
        self.open: dict[str, Open] = {}  # rid -> request
        self.by_client: dict[tuple[bytes, str], str] = {}  # (identity, req_id) -> rid
        self.accepting = True
        self.refusal = "server is shutting down"
        self._ids = itertools.count(1)
        self._prefix = f"{os.getpid():x}"
        # Grammars compile off the event loop (llguidance compiles lazily: ~0.1 ms for a
        # schema, but a hostile one may take seconds); `wake` is the shell's thread-safe nudge.
        self.compiles = Compiles()
        self.compiling: dict[tuple[bytes, str], Compiling] = {}
        self.wake: Callable[[], None] = lambda: None
        self._specials: frozenset[str] | None = None

    # -- from clients ------------------------------------------------------------------------

    def on_client(self, frames: list[bytes], now: float) -> tuple[list[Reply], list[Outbound]]:
        """One ROUTER message -> (replies to clients, encoded messages for the scheduler)."""
        try:
            return self._on_client(frames, now)
        except Exception as e:  # a bug of ours: this frame fails, the actor keeps serving
            return self._internal_error(frames[0], "", "", e)

    def _on_client(self, frames: list[bytes], now: float) -> tuple[list[Reply], list[Outbound]]:
        identity, payload = frames[0], frames[1:]
        if len(payload) != 1:
            return self._reject(identity, "", "malformed message: expected 1 payload frame, "
                                f"got {len(payload)}")
        try:
            msg = decode_frame(payload[0], self.limits)
        except RequestError as e:
            return self._reject(identity, _guess_req_id(payload[0]), e.message, e.code)
        match msg:
            case m.AbortRequest():
                return [], self.abort(identity, msg.req_id, "request.client_abort")
            case m.GenerateRequest():
                if (refused := self._unauthorized(msg)) is not None:
                    return self._reject(identity, msg.req_id, refused, 401)
                return self.submit(identity, msg, now)

    def _unauthorized(self, req: m.GenerateRequest) -> str | None:
        """Why a ZMQ request may not run, when the server has an api_key: never echoes a key."""
        if not self.api_key:
            return None
        if not req.api_key:
            return "missing api_key: this server requires one (Client(api_key=...), --api-key)"
        if not hmac.compare_digest(req.api_key.encode(), self.api_key):
            return "invalid api_key: not the key this server was started with"
        return None

    def _reject(self, identity: bytes, req_id: str, message: str, code: int = 400,
                peer: str = "") -> tuple[list[Reply], list[Outbound]]:
        # The peer, never the prompt: logs must not carry what clients sent.
        self.log.warning("request.rejected", req_id=req_id[:64], error=message[:300], code=code,
                         peer=peer or identity.hex())
        return [(identity, m.ErrorReply(req_id=req_id, message=message, code=code))], []

    def client_gone(self, identity: bytes) -> list[Outbound]:
        """The connection of a ZMQ client closed: abort what it left open (no one is left to
        read the replies)."""
        return [a for who, req_id in [*self.by_client, *self.compiling] if who == identity
                for a in self.abort(who, req_id, "request.client_gone")]

    def abort(self, identity: bytes, req_id: str, event: str) -> list[Outbound]:
        """The client's open request req_id, if any, as an Abort for its scheduler (logged as
        `event`); the request stays open until the scheduler's terminal reply."""
        if (waiting := self.compiling.get((identity, req_id))) is not None:
            waiting.aborted = event  # answered by `compiled`, which the wake brings soon
            self.wake()
            return []
        rid = self.by_client.get((identity, req_id))
        if not rid:
            return []
        self.log.info(event, rid=rid, req_id=req_id)
        return [(self.open[rid].replica, encode(m.Abort(rid=rid)))]

    def submit(self, identity: bytes, req: m.GenerateRequest, now: float,
               peer: str = "") -> tuple[list[Reply], list[Outbound]]:
        """A decoded request from any front end (ZMQ, HTTP) -> a refusal, the encoded
        TokenizedRequest of a request now open, or nothing while its grammar compiles
        (`compiled` answers it then)."""
        try:
            check_request(req, self.limits)
            return self._open(identity, req, now, peer)
        except RequestError as e:
            return self._reject(identity, req.req_id, e.message, e.code, peer)
        except Exception as e:  # a bug of ours: this request fails, the actor keeps serving
            return self._internal_error(identity, req.req_id, peer, e)

    def _internal_error(self, identity: bytes, req_id: str, peer: str,
                        e: Exception) -> tuple[list[Reply], list[Outbound]]:
        self.internal_errors += 1
        self.log.warning("request.internal_error", req_id=req_id[:64],
                         peer=peer or identity.hex(), error=repr(e)[:300], exc_info=True)
        return [(identity, m.ErrorReply(req_id=req_id, message="internal error: "
                                        f"{type(e).__name__}", code=500))], []

    def _open(self, identity: bytes, req: m.GenerateRequest, now: float, peer: str = "",
              compiled: tuple[list[int], str, str] | None = None
              ) -> tuple[list[Reply], list[Outbound]]:
        """compiled: (ids, kind, grammar) of a request whose grammar has compiled since its
        checks (`compiled`); without it, a request with a constraint starts its compile."""
        if not self.accepting:
            raise RequestError(self.refusal, 503)
        if compiled is None:
            if not req.req_id:
                raise RequestError("req_id must be a non-empty string", param="req_id")
            key = (identity, req.req_id)
            if key in self.by_client or key in self.compiling:
                raise RequestError(f"req_id {req.req_id[:64]!r} is already open on this "
                                   "connection", param="req_id")
            ids = self.tokenize(req)
            self._check_params(req)
            given = self._constraint_source(req)
            if len(ids) >= self.model.context_length:
                raise RequestError(f"prompt has {len(ids)} tokens; the model's context is "
                                   f"{self.model.context_length} tokens, output included")
            if given is not None:
                return self._compile(identity, req, now, peer, ids, *given)
            constraint = ("", "")
        else:
            ids, constraint = compiled[0], compiled[1:]
        rid = f"{self._prefix}-{next(self._ids)}"
        group = f"{identity.hex()}/{req.group}" if req.group else ""
        # Encoded before the request is registered: nothing after this line can fail.
        params = sampling_params(req, *constraint, cap=self.limits.max_output_tokens)
        data = encode(m.TokenizedRequest(rid=rid, input_ids=pack_ids(ids), params=params,
                                         group=group))
        route = self.router.route(ids, group, req.session)
        self.open[rid] = Open(rid, identity, req.req_id, req.stream, len(ids), now,
                              replica=route.replica, group=group,
                              prompt=self._prompt(req, ids),
                              scoring=req.logprob_start_len >= 0)
        self.by_client[(identity, req.req_id)] = rid
        where = {"replica": route.replica, "routed_by": route.reason,
                 "routed_prefix_tokens": route.matched} if self.router.replicas > 1 else {}
        self.log.info("request.received", rid=rid, req_id=req.req_id, prompt_tokens=len(ids),
                      max_new_tokens=req.max_new_tokens, stream=req.stream, **where)
        return [], [(route.replica, data)]

    def _prompt(self, req: m.GenerateRequest, ids: list[int]) -> dict[str, Any] | None:
        """What the first reply gives back of the prompt, for echo and prompt logprobs."""
        if not req.echo and req.logprob_start_len < 0:
            return None
        text = ""
        if req.echo:
            text = req.prompt or self.tokenizer.decode(ids)
        return {"prompt_ids": ids, "prompt_text": text}

    def _check_params(self, req: m.GenerateRequest) -> None:
        """What the schema cannot say: ids against this model's vocabulary, and relations
        between fields. Raises RequestError naming the field."""
        vocab = self.model.vocab_size
        for name, ids in (("input_ids", req.input_ids), ("stop_token_ids", req.stop_token_ids),
                          ("logit_bias", list(req.logit_bias))):
            bad = [t for t in ids if not 0 <= t < vocab]
            if bad:
                raise RequestError(f"{name}: token id {bad[0]} is outside the vocabulary "
                                   f"[0, {vocab})", param=name)
        if req.min_new_tokens > req.max_new_tokens:
            raise RequestError(f"min_new_tokens ({req.min_new_tokens}) is more than "
                               f"max_new_tokens ({req.max_new_tokens})", param="min_new_tokens")
        if any(not s for s in req.stop):
            raise RequestError("stop: a stop string must not be empty", param="stop")

    def _constraint_source(self, req: m.GenerateRequest) -> tuple[str, str] | None:
        """The request's constraint as (kind, source), None for none; RequestError when it
        gives more than one."""
        given = [(kind, source) for kind, source in (
            ("json_schema", req.json_schema), ("regex", req.regex), ("ebnf", req.ebnf),
            ("structural_tag", req.structural_tag)) if source]
        if not given:
            return None
        if len(given) > 1:
            raise RequestError(f"give at most one of json_schema, regex, ebnf and "
                               f"structural_tag, not {' and '.join(k for k, _ in given)}",
                               param=given[1][0])
        return given[0]

    def _compile(self, identity: bytes, req: m.GenerateRequest, now: float, peer: str,
                 ids: list[int], kind: str, source: str) -> tuple[list[Reply], list[Outbound]]:
        if self._specials is None:
            self._specials = self.tokenizer.specials()
        job = self.compiles.start(kind, source, self._specials, self.wake)
        if job is None:
            raise RequestError(f"{kind}: {self.compiles.most} grammars are compiling already; "
                               "retry when one is done", 503, param=kind)
        self.compiling[(identity, req.req_id)] = Compiling(
            identity, req, now, peer, ids, kind, job, now + self.limits.grammar_timeout_s)
        self.wake()  # a new deadline for the shell to wait for
        return [], []

    def next_deadline(self) -> float | None:
        """When the first compile still running times out (None: none is running)."""
        return min((c.deadline for c in self.compiling.values()), default=None)

    def compiled(self, now: float) -> tuple[list[Reply], list[Outbound]]:
        """Every request whose compile ended, timed out or was aborted meanwhile, opened or
        answered: (replies to clients, encoded messages for the schedulers)."""
        replies: list[Reply] = []
        forward: list[Outbound] = []
        for key, c in list(self.compiling.items()):
            if not (c.aborted or c.job.done() or now >= c.deadline):
                continue
            del self.compiling[key]
            if c.aborted:
                self.log.info(c.aborted, req_id=c.req.req_id, compiling=c.kind)
                replies.append((c.identity, m.Finished(
                    req_id=c.req.req_id, text="", token_ids=[], finish_reason="abort",
                    prompt_tokens=len(c.ids), completion_tokens=0, total_s=now - c.received)))
                continue
            out, fwd = self._opened(c, now)
            replies += out
            forward += fwd
        return replies, forward

    def _opened(self, c: Compiling, now: float) -> tuple[list[Reply], list[Outbound]]:
        timeout = self.limits.grammar_timeout_s
        try:
            if not c.job.done():  # its thread runs on; the request no longer waits for it
                raise RequestError(f"{c.kind}: did not compile within "
                                   f"limits.grammar_timeout_s ({timeout:g} s)", param=c.kind)
            try:
                grammar = c.job.result()
            except GrammarError as e:
                raise RequestError(f"{c.kind}: {e}", param=c.kind) from None
            return self._open(c.identity, c.req, c.received, c.peer,
                              compiled=(c.ids, c.kind, grammar))
        except RequestError as e:
            return self._reject(c.identity, c.req.req_id, e.message, e.code, c.peer)
        except Exception as e:  # a bug of ours: this request fails, the actor keeps serving
            return self._internal_error(c.identity, c.req.req_id, c.peer, e)

    def tokenize(self, req: m.GenerateRequest) -> list[int]:
        """A request's prompt tokens (its text, token ids or chat messages rendered by the
        model's template); RequestError naming the field that cannot be tokenized."""
        given = sum(map(bool, (req.prompt, req.input_ids, req.messages)))
        if given == 0:
            raise RequestError("empty prompt: give one of prompt, input_ids or messages")
        if given > 1:
            raise RequestError("give only one of prompt, input_ids or messages")
        if req.input_ids:
            return list(req.input_ids)
        if req.messages:
            # Without the fields a message leaves at their defaults (omit_defaults): the
            # template tests for what a message has, not for "".
            msgs = msgspec.to_builtins(req.messages)
            tools = {"tools": req.tools} if req.tools else {}
            try:
                ids = self.tokenizer.apply_chat_template(msgs, **tools,
                                                         **req.chat_template_kwargs)
            except Exception as e:  # a template error is the request's problem, not ours
                raise RequestError(f"messages: the chat template failed: {str(e)[:200]}",
                                   param="messages") from None
        else:
            try:
                ids = self.tokenizer.encode(req.prompt)
            except Exception as e:  # e.g. a lone surrogate from a JSON escape
                raise RequestError(f"prompt: cannot be tokenized: {str(e)[:200]}",
                                   param="prompt") from None
        if not ids:
            raise RequestError("empty prompt: it tokenizes to no tokens")
        return ids

    # -- from the detokenizer ----------------------------------------------------------------

    def on_text(self, batch: m.TextBatch, now: float) -> list[Reply]:
        replies: list[Reply] = []
        self.last_progress = now
        pieces = split_counts(unpack_ids(batch.token_ids), batch.counts)
        lps = (split_counts(batch.logprobs, batch.counts), split_counts(batch.top_ids, batch.counts),
               split_counts(batch.top_logprobs, batch.counts)) if batch.logprobs else None
        for rid, scores in batch.prompt_scores.items():
            req = self.open.get(rid)
            if req is not None and req.scoring and req.prompt is not None:
                req.prompt.update(prompt_columns(len(req.prompt["prompt_ids"]), scores))
                req.scoring = False
        for k, (rid, text, ids) in enumerate(zip(batch.rids, batch.texts, pieces)):
            req = self.open.get(rid)
            if req is None:
                continue
            lp, tids, tlps = (lps[0][k], lps[1][k], lps[2][k]) if lps else ([], [], [])
            req.logprobs += lp
            req.top_ids += tids
            req.top_logprobs += tlps
            if ids and not req.first_token:
                req.first_token = now
                self.log.info("request.first_token", rid=rid,
                              ttft_s=round(now - req.received, 6))
            req.token_ids.extend(ids)
            if req.stream:
                if text or ids:
                    replies.append((req.identity, m.Delta(req_id=req.req_id, text=text,
                                                          token_ids=ids, logprobs=lp,
                                                          top_ids=tids, top_logprobs=tlps,
                                                          **self._prompt_once(req))))
            else:
                req.texts.append(text)
        for fin in batch.finished:
            req = self.open.pop(fin.rid, None)
            if req is None:
                continue
            self.by_client.pop((req.identity, req.req_id), None)
            self.router.done(req.replica, req.group)
            replies.append((req.identity, self._final(req, fin, now)))
            where = {"replica": req.replica} if self.router.replicas > 1 else {}
            self.log.info("request.finished", rid=fin.rid, reason=fin.reason, **where,
                          prompt_tokens=req.prompt_tokens, completion_tokens=len(req.token_ids),
                          cached_tokens=fin.cached_tokens, error=fin.message or None,
                          ttft_s=round(req.first_token - req.received, 6) if req.first_token
                          else None, total_s=round(now - req.received, 6))
        return replies

    def _final(self, req: Open, fin: m.Finish, now: float) -> m.ClientWire:
        if fin.reason == "error":
            return m.ErrorReply(req_id=req.req_id, message=fin.message, code=fin.code)
        return m.Finished(
            req_id=req.req_id, text="" if req.stream else "".join(req.texts),
            token_ids=req.token_ids, finish_reason=fin.reason,
            prompt_tokens=fin.prompt_tokens or req.prompt_tokens,
            completion_tokens=len(req.token_ids), cached_tokens=fin.cached_tokens,
            ttft_s=(req.first_token - req.received) if req.first_token else 0.0,
            total_s=now - req.received, logprobs=req.logprobs, top_ids=req.top_ids,
            top_logprobs=req.top_logprobs, stop_str=fin.stop_str,
            **self._prompt_once(req, last=True))

    @staticmethod
    def _prompt_once(req: Open, last: bool = False) -> dict[str, Any]:
        """The prompt's fields for the first reply that can carry them: once its scores are
        in (or none were asked), or the last reply."""
        if req.prompt is None or (req.scoring and not last):
            return {}
        fields, req.prompt = req.prompt, None
        return fields

    def fail_all(self, message: str, code: int = 503) -> list[Reply]:
        """End every open request with an error (shutdown, a dead actor)."""
        replies = [(r.identity, m.ErrorReply(req_id=r.req_id, message=message, code=code))
                   for r in self.open.values()]
        replies += [(c.identity, m.ErrorReply(req_id=c.req.req_id, message=message, code=code))
                    for c in self.compiling.values()]
        self.open.clear()
        self.by_client.clear()
        self.compiling.clear()
        return replies


def prompt_columns(length: int, scores: m.PromptScores) -> dict[str, list]:
    """A prompt's scores as per-position columns: None / [] where not scored (position 0,
    those before logprob_start_len)."""
    pad = min(scores.start, length)
    return {"prompt_logprobs": [None] * pad + list(scores.logprobs),
            "prompt_top_ids": [[]] * pad + list(scores.top_ids),
            "prompt_top_logprobs": [[]] * pad + list(scores.top_logprobs)}


def sampling_params(req: m.GenerateRequest, constraint_kind: str = "",
                    constraint: str = "", cap: int = 0) -> m.SamplingParams:
    """constraint: the compiled grammar of the request's constraint (Frontend.constraint);
    cap: limits.max_output_tokens, the most output tokens any request gets (0: no cap)."""
    most = min(req.max_new_tokens, cap) if cap else req.max_new_tokens
    return m.SamplingParams(
        max_new_tokens=most, temperature=req.temperature,
        stop_token_ids=list(req.stop_token_ids), ignore_eos=req.ignore_eos, top_p=req.top_p,
        top_k=req.top_k, min_p=req.min_p, repetition_penalty=req.repetition_penalty,
        frequency_penalty=req.frequency_penalty, presence_penalty=req.presence_penalty,
        bias_ids=list(req.logit_bias), bias_values=list(req.logit_bias.values()),
        seed=-1 if req.seed is None else req.seed, min_new_tokens=min(req.min_new_tokens, most),
        stop=list(req.stop), logprobs=req.logprobs or req.top_logprobs > 0,
        top_logprobs=req.top_logprobs, prompt_logprobs_from=req.logprob_start_len,
        constraint_kind=constraint_kind, constraint=constraint)


def _guess_req_id(payload: bytes) -> str:
    """Best effort: the req_id of a request that failed validation, so the client can match
    the error to its request."""
    try:
        raw = msgspec.msgpack.decode(payload)
    except Exception:
        return ""
    rid = raw.get("req_id") if isinstance(raw, dict) else None
    # Echoed whole, however long: a client matches replies by the exact id (one with "" is
    # taken by the async client as an error for every request it has open).
    return rid if isinstance(rid, str) else ""
