"""What the fuzz job (tools/fuzz/job.py) sends, and what the server must do with it: each
input comes with a verdict,

- "ok": served (Finished, HTTP 200);
- "bad": refused with a 4xx (ErrorReply code 4xx, HTTP 4xx);
- "any": either, but never a 5xx other than 503, and always exactly one terminal reply.

This module has the pieces both surfaces share: values drawn from a field's msgspec schema type
(right ones, wrong types, out-of-range and past-64-bit numbers, NaN, invalid UTF-8), byte
mutations, and the seeded hypothesis drawing. The ZMQ frames are frames.py, the HTTP bodies
bodies.py. Valid-looking requests ask for at most 8 new tokens, so the job's time goes into
fuzzing, not generating. Pure: no sockets.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

from hypothesis import HealthCheck, Phase, given, seed, settings, strategies as st
from msgspec import inspect as mi

from tools.fuzz.wire import (INT64_MAX, INT64_MIN, UINT64_MAX, Bounds, Ext, F32, Raw,
                                  Str, accepted, bounds_of, fields_of, plain_type)
from protocol import messages as m

OK, BAD, ANY = "ok", "bad", "any"
MAX_NEW = 8  # new tokens a valid-looking fuzz request may ask for
MAX_MUTATED_TOKENS = 64  # a mutation that turned into a long generation is dropped (cost)
# The wire field an OpenAI field becomes (its range is the wire's).
WIRE_NAME = {"max_tokens": "max_new_tokens", "max_completion_tokens": "max_new_tokens",
             "min_tokens": "min_new_tokens", "logprobs": "top_logprobs"}
# Served values: (lo, hi, whether the rest of the schema's range is "any" rather than skipped
# because it is too expensive to generate). The OpenAI documented ranges where narrower.
WINDOWS = {"max_new_tokens": (1, MAX_NEW, False), "min_new_tokens": (0, MAX_NEW, False),
           "temperature": (0, 2, True), "top_p": (0.05, 1, True), "top_k": (-1, 100, True),
           "min_p": (0, 1, True), "repetition_penalty": (0.5, 2, True),
           "frequency_penalty": (-2, 2, True), "presence_penalty": (-2, 2, True),
           "seed": (0, INT64_MAX - 16, True), "top_logprobs": (0, 20, True), "n": (1, 3, True)}
BAD_UTF8 = [b"\xff", b"\xc3", b"\xed\xa0\x80", b"\xf4\x90\x80\x80", b"\xc0\xaf", b"\x80",
            b"\xfe\xfe", b"\xe2\x82"]
ROLES = ["system", "user", "assistant"]


@dataclass
class Case:
    """One input, ready to send, and what the server must do with it."""

    surface: str  # zmq | http
    kind: str  # the generator that made it (outcomes are counted per kind too)
    verdict: str  # ok | bad | any
    note: str = ""  # what is odd about it, for the report
    frames: list[bytes] = field(default_factory=list)  # zmq
    path: str = ""  # http
    body: bytes = b""  # http
    req_id: str | None = None  # zmq: the req_id the reply must carry (None: unknown)
    expect_reply: bool = True  # zmq: a valid AbortRequest gets none

    def show(self, limit: int = 400) -> str:
        """repr of the bytes, cut to `limit` characters, with the full length."""
        data = self.frames if self.surface == "zmq" else self.body
        size = sum(map(len, data)) if self.surface == "zmq" else len(data)
        text = repr(data)
        cut = text if len(text) <= limit else text[:limit] + "...<cut>"
        where = f"POST {self.path} " if self.surface == "http" else ""
        return f"{where}[{self.kind}/{self.verdict}] {self.note} ({size} bytes) {cut}"


@dataclass(frozen=True)
class Rid:
    """Where the case's unique req_id goes (known once the case has its index)."""

    suffix: str = ""


@dataclass
class Draft:
    """A drawn input before it has its req_id: `make(req_id)` gives the frames or body."""

    kind: str
    verdict: str | None  # None: decided from the bytes (mutations)
    note: str
    make: Callable[[str], Any]
    path: str = ""


def worst(*verdicts: str) -> str:
    return BAD if BAD in verdicts else ANY if ANY in verdicts else OK


def _fill(obj: Any, rid: str) -> Any:
    """The request with its Rid placeholders replaced (top level and one level down)."""
    if isinstance(obj, Rid):
        return rid + obj.suffix
    if isinstance(obj, dict):
        return {k: _fill(v, rid) for k, v in obj.items()}
    return obj


def _short(v: Any) -> str:
    text = repr(v)
    return text if len(text) <= 60 else f"{text[:50]}...({len(text)} chars)"


V = tuple[Any, str, str]  # a drawn value, its verdict, a note on it


def _v(strategy: st.SearchStrategy, verdict: str, why: str = "") -> st.SearchStrategy[V]:
    return strategy.map(lambda x: (x, verdict, why))


class Values:
    """Value strategies for one model: its vocabulary size, context length and token counter
    (long prompts are judged by their real token count). Each field's strategies come in pairs:
    (ok values, odd values), every value drawn with its verdict and a note."""

    def __init__(self, vocab: int, context: int, count_tokens: Callable[[str], int]):
        self.vocab, self.context, self.count_tokens = vocab, context, count_tokens
        self.wire = fields_of(m.GenerateRequest)
        self.text = st.text(st.characters(exclude_categories=("Cs",)), min_size=1, max_size=24)
        self.ids = st.lists(st.integers(0, self.vocab - 1), min_size=1, max_size=24)

    # -- values ------------------------------------------------------------------------------

    def junk(self, cats: set[str], json_mode: bool) -> st.SearchStrategy:
        """A value of any category outside `cats` (a wrong type)."""
        big = [10**30, -(10**30), 2**64] if json_mode else []
        pool = {"nil": st.none(), "bool": st.booleans(),
                "int": st.one_of(st.sampled_from([-1, 0, 1, INT64_MAX, INT64_MAX + 1,
                                                  UINT64_MAX, INT64_MIN, *big]),
                                 st.integers(INT64_MIN, UINT64_MAX)),
                "float": st.one_of(st.sampled_from([math.nan, math.inf, -math.inf, -0.0, 1e308,
                                                    5e-324, 0.5]), st.floats(),
                                   *([] if json_mode else [st.floats(width=32).map(F32)])),
                "str": st.text(max_size=8),
                "list": st.lists(st.one_of(st.integers(-3, 3), st.text(max_size=3), st.none()),
                                 max_size=4),
                "map": st.dictionaries(st.text(max_size=4), st.integers(-3, 3), max_size=3)}
        if not json_mode:
            pool["bin"] = st.binary(max_size=12)
            pool["ext"] = st.builds(Ext, st.integers(-128, 127),
                                    st.binary(min_size=1, max_size=16))
        wrong = [s for cat, s in pool.items() if cat not in cats]
        return st.one_of(wrong) if wrong else st.nothing()

    def hashable_junk(self) -> st.SearchStrategy:
        """Map keys that are not strings (msgpack allows any)."""
        return st.one_of(st.integers(INT64_MIN, UINT64_MAX), st.booleans(), st.none(),
                         st.binary(max_size=6), st.floats(allow_nan=False), st.builds(
                             Ext, st.integers(-128, 127), st.binary(min_size=1, max_size=4)))

    def bad_utf8(self) -> st.SearchStrategy[Str]:
        piece = st.text(max_size=6).map(lambda t: t.encode())
        return st.builds(lambda a, b, c: Str(a + b + c), piece, st.sampled_from(BAD_UTF8), piece)

    def numeric(self, bounds: list[tuple[Bounds, Callable]], window: tuple, json_mode: bool,
                kind: type) -> tuple[st.SearchStrategy[V], st.SearchStrategy[V]]:
        """(served values, odd values) of a number that must hold every (bounds, transform)."""
        lo, hi, spare = window
        for b, f in bounds:
            if f is _same:
                lo, hi = b.clip(lo, hi)
        ok = (st.integers(int(lo), int(hi)) if kind is int
              else st.floats(lo, hi, allow_nan=False, allow_infinity=False))

        def judge(v: Any) -> V:
            try:
                held = all(b.holds(f(v)) for b, f in bounds)
            except (TypeError, ValueError, OverflowError):
                held = False
            if not held:
                return v, BAD, "out of range"
            inside = lo <= v <= hi and not (isinstance(v, float) and math.isnan(v))
            return v, OK if inside else ANY if spare else "skip", "beyond the documented range"

        edges = {0, -1, 1, int(lo) - 1, int(hi) + 1, INT64_MAX, INT64_MIN, INT64_MAX + 1,
                 UINT64_MAX} | ({10**30, -(10**30), 2**64} if json_mode else set())
        for b, _ in bounds:
            for e in (b.lo, b.hi):
                if e is not None:
                    edges |= {e - 1, e, e + 1} if kind is int else {e - 0.5, e, e + 1e-9}
        if kind is float:
            edges |= {math.nan, math.inf, -math.inf, 1e30, -1e30, 1e-300}
        if not json_mode:  # msgpack holds int64..uint64 only
            edges = {e for e in edges if not isinstance(e, int) or INT64_MIN <= e <= UINT64_MAX}
        candidates = st.sampled_from(sorted(edges, key=repr))
        ints = st.integers() if json_mode else st.integers(INT64_MIN, UINT64_MAX)
        values = st.one_of(candidates, candidates, st.floats() if kind is float else ints)
        odd = values.map(judge).filter(lambda x: x[1] != "skip")
        if kind is float and json_mode:  # beyond float64 in the text: 1e999
            odd = st.one_of(odd, st.just((Raw(b"1e999"), BAD if any(
                b.hi is not None for b, _ in bounds) else ANY, "1e999")))
        return _v(ok, OK), odd

    def generic(self, t: mi.Type, name: str, json_mode: bool,
                extra: list[tuple[Bounds, Callable]] = ()) -> tuple[st.SearchStrategy[V], ...]:
        """(ok, odd) values of a field from its schema type alone."""
        plain, nullable = plain_type(t)
        wrong = _v(self.junk(accepted(t), json_mode), BAD, "wrong type")
        b = bounds_of(plain)
        if b is not None:
            wire = bounds_of(self.wire[WIRE_NAME.get(name, name)].type) \
                if WIRE_NAME.get(name, name) in self.wire else None
            checks = [(b, _same), *extra] + ([(wire, _same)] if wire and not extra else [])
            window = WINDOWS.get(WIRE_NAME.get(name, name), (*b.clip(0, MAX_NEW), False))
            ok, odd = self.numeric(checks, window, json_mode, b.kind)
        elif isinstance(plain, mi.BoolType):
            ok, odd = _v(st.booleans(), OK), st.nothing()
        elif isinstance(plain, mi.StrType):
            ok = _v(self.text, OK)
            odd = st.one_of(_v(st.just("x" * 100_000), ANY, "100k chars"),
                            _v(st.just("\ud800x") if json_mode else st.nothing(), ANY,
                               "lone surrogate"))
        elif isinstance(plain, (mi.ListType, mi.DictType, mi.StructType)):
            ok, odd = _v(st.just([] if isinstance(plain, mi.ListType) else {}), OK), st.nothing()
        else:  # Any, or a type this job does not know yet: every value may do
            ok, odd = _v(self.junk(set(), json_mode), ANY, "any value"), st.nothing()
        if nullable:
            ok = st.one_of(ok, _v(st.none(), OK))
        return ok, st.one_of(odd, wrong, _v(self.bad_utf8(), BAD, "invalid UTF-8"))

    def stop_odd(self, json_mode: bool) -> st.SearchStrategy[V]:
        return st.one_of(_v(st.just([""]), BAD, "empty stop string"),
                         _v(st.lists(self.text, min_size=17, max_size=20), BAD, "17+ stops"),
                         _v(st.just(["s" * 50_000]), ANY, "50k-char stop"),
                         _v(st.lists(self.junk({"str"}, json_mode), min_size=1, max_size=2), BAD,
                            "wrong item type"),
                         _v(st.lists(self.bad_utf8(), min_size=1, max_size=2), BAD,
                            "invalid UTF-8"))

    def bias_odd(self, json_mode: bool) -> st.SearchStrategy[V]:
        key = (lambda t: str(t)) if json_mode else (lambda t: t)
        tid = st.integers(0, self.vocab - 1).map(key)
        return st.one_of(
            _v(st.dictionaries(tid, st.sampled_from([100.5, -101.0, 1e9, -1e30]), min_size=1,
                               max_size=2), BAD, "bias value out of [-100, 100]"),
            _v(st.dictionaries(tid, st.sampled_from([math.nan, math.inf, -math.inf]),
                               min_size=1, max_size=2), BAD, "bias value not finite"),
            _v(st.dictionaries(st.sampled_from([-1, self.vocab, 2**40]).map(key),
                               st.floats(-100, 100), min_size=1, max_size=2), BAD,
               "bias key outside vocab"),
            _v(st.dictionaries(st.sampled_from(["abc", "1.5", ""]) if json_mode
                               else st.text(max_size=3), st.floats(-100, 100), min_size=1,
                               max_size=2), BAD, "bias key not a token id"),
            _v(st.just({key(k): 1.0 for k in range(0, 30_000, 3)}), ANY, "10k biases"))

    def messages(self, json_mode: bool) -> st.SearchStrategy[V]:
        one = st.fixed_dictionaries({"role": st.sampled_from(ROLES), "content": self.text})
        return _v(st.lists(one, min_size=1, max_size=3), OK)

    def messages_odd(self, json_mode: bool) -> st.SearchStrategy[V]:
        wrong = self.junk({"str"}, json_mode)
        return st.one_of(
            _v(st.just([{"content": "hi"}]), BAD, "no role"),
            _v(st.builds(lambda r: [{"role": r, "content": "hi"}], wrong), BAD, "role type"),
            _v(st.builds(lambda r: [{"role": "user", "content": r}],
                         self.junk({"str", "nil", "list"} if json_mode else {"str"}, json_mode)),
               BAD, "content type"),
            _v(st.builds(lambda r: [{"role": r, "content": "hi"}], self.bad_utf8()), BAD,
               "role not UTF-8"),
            _v(st.builds(lambda r: [{"role": "user", "content": r}], self.bad_utf8()), BAD,
               "content not UTF-8"),
            _v(st.builds(lambda r: [{"role": r, "content": "hi"}], self.text), ANY, "odd role"),
            _v(st.just([{"role": "user", "content": "hi"}] * 5000), ANY, "5000 messages"))


def _same(v: Any) -> Any:
    """The value as the wire takes it (see Values.numeric's transforms)."""
    return v


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


# -- byte mutations ------------------------------------------------------------------------------

OPS = ("flip", "truncate", "insert", "delete", "splice", "repeat", "set")
SPECIAL = [0xC1, 0xFF, 0xDD, 0xDF, 0xDB, 0xC6, 0xC0, 0x00, 0x7B, 0x5B, 0x22, 0x5C]


def mutation_ops() -> st.SearchStrategy[list]:
    """1-3 ops; positions as fractions of the length, so one draw fits any base."""
    op = st.tuples(st.sampled_from(OPS), st.floats(0, 1), st.floats(0, 1),
                   st.integers(0, 255), st.binary(min_size=1, max_size=8))
    return st.lists(op, min_size=1, max_size=3)


def mutate(data: bytes, other: bytes, ops: list) -> bytes:
    for name, a, b, byte, blob in ops:
        n = len(data)
        at = min(int(a * n), max(n - 1, 0))  # one position, for the single-point ops
        lo, hi = sorted((int(a * n), int(b * n)))  # a range, for the others
        match name:
            case "flip" if n:
                data = data[:at] + bytes([data[at] ^ (1 << (byte % 8))]) + data[at + 1:]
            case "truncate":
                data = data[:int(a * n)]
            case "insert":
                data = data[:at] + blob + data[at:]
            case "delete":
                data = data[:lo] + data[hi:]
            case "splice":
                data = data[:int(a * n)] + other[int(b * len(other)):]
            case "repeat":
                data = data[:lo] + data[lo:hi] * (2 + byte % 6) + data[hi:]
            case "set" if n:
                data = data[:at] + bytes([SPECIAL[byte % len(SPECIAL)]]) + data[at + 1:]
    return data


def describe_ops(ops: list) -> str:
    return "mutated: " + ", ".join(f"{name}@{a:.2f}" for name, a, *_ in ops)


# -- drawing -------------------------------------------------------------------------------------


def draw(strategy: st.SearchStrategy, n: int, seed_: int) -> list:
    """n examples of a strategy, drawn by hypothesis with a fixed seed (no database, no
    shrinking: this is generation, not a test)."""
    out: list = []

    @settings(max_examples=n, database=None, deadline=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck), derandomize=False)
    @seed(seed_)
    @given(strategy)
    def collect(x: Any) -> None:
        out.append(x)

    collect()
    return out


def cases(strategy: st.SearchStrategy, finish: Callable[[Draft, int], Case | None], n: int,
          seed_: int, batch: int = 250) -> Iterator[Case]:
    """n cases, drawn in batches (memory stays small; huge inputs are built as they go).
    `finish(draft, index)` makes the case, or None to drop it (a mutation turned costly)."""
    made, round_ = 0, 0
    while made < n and round_ < 4 * (n // batch + 2):
        for d in draw(strategy, min(batch, n - made), seed_ * 1_000_003 + round_):
            case = finish(d, made)
            if case is not None and made < n:
                made += 1
                yield case
        round_ += 1
