"""ZMQ frames for the fuzz job (tools/fuzz/job.py): GenerateRequest and AbortRequest maps
drawn from the msgspec schema (protocol/messages.py) with some fields odd, invalid UTF-8 in
every kind of string, nesting up to 100,000 deep, long strings and lists, prompts at the edge
of the context, wrong frame counts, garbage, and byte mutations of valid requests."""

from __future__ import annotations

from typing import Any

from hypothesis import strategies as st

from tools.fuzz.cases import (ANY, BAD, MAX_MUTATED_TOKENS, OK, Case, Draft, Rid, V,
                                   Values, _fill, _is_int, _short, _v, describe_ops, mutate,
                                   mutation_ops, worst)
from tools.fuzz.wire import (INT64_MAX, UINT64_MAX, Str, bounds_of, claimed_req_id,
                                  decodes, nest, pack, tag_of)
from protocol import messages as m


class Frames(Values):
    """Strategies of ZMQ frames (Drafts); `case()` is the mix the job sends."""

    def fields(self) -> dict[str, tuple[st.SearchStrategy[V], st.SearchStrategy[V]]]:
        """(ok, odd) per GenerateRequest field, schema-derived unless the field has rules the
        schema cannot say (token ids against the vocabulary, non-empty stop strings...)."""
        out = {name: self.generic(f.type, name, False) for name, f in self.wire.items()}
        tid = st.integers(0, self.vocab - 1)
        bad_ids = st.sampled_from([-1, self.vocab, self.vocab + 1000, 2**31, UINT64_MAX])
        ids_odd = st.one_of(_v(st.lists(bad_ids, min_size=1, max_size=3), BAD, "id outside vocab"),
                            _v(st.lists(self.junk({"int"}, False), min_size=1, max_size=3), BAD,
                               "wrong item type"),
                            _v(st.just(list(range(20_000))), ANY, "20k ids"))
        out["stop_token_ids"] = (_v(st.lists(tid, max_size=4), OK), ids_odd)
        out["input_ids"] = (_v(self.ids, OK), ids_odd)
        out["stop"] = (_v(st.lists(self.text, max_size=3), OK), self.stop_odd(False))
        out["logit_bias"] = (_v(st.dictionaries(tid, st.floats(-100, 100), max_size=4), OK),
                             self.bias_odd(False))
        out["messages"] = (self.messages(False), self.messages_odd(False))
        out["chat_template_kwargs"] = (
            _v(st.one_of(st.just({}), st.builds(lambda b: {"enable_thinking": b}, st.booleans())),
               OK),
            st.one_of(_v(st.dictionaries(st.text(max_size=6), self.junk(set(), False),
                                         max_size=3), ANY, "odd kwargs"),
                      _v(st.dictionaries(self.hashable_junk(), st.none(), min_size=1,
                                         max_size=2), BAD, "non-str key"),
                      _v(st.sampled_from([10, 65, 1000, 100_000]).map(
                          lambda d: {"a": nest(d, False, False)}), ANY, "deep value")))
        out["req_id"] = (_v(st.builds(Rid, st.text(max_size=8)), OK),
                         st.one_of(_v(st.just(""), BAD, "empty req_id"),
                                   _v(st.just(Rid("r" * 100_000)), ANY, "100k-char req_id"),
                                   _v(self.junk({"str"}, False), BAD, "wrong type"),
                                   _v(self.bad_utf8(), BAD, "invalid UTF-8")))
        out["group"] = (_v(st.one_of(st.just(""), self.text), OK), out["group"][1])
        # Constraints: none, or anything (a constraint compiles or is a 400 naming it).
        for name in ("json_schema", "regex", "ebnf", "structural_tag"):
            out[name] = (_v(st.just(""), OK), _v(self.text, ANY, f"odd {name}"))
        out["tools"] = (_v(st.just([]), OK), _v(st.lists(st.dictionaries(
            st.text(max_size=6), self.junk(set(), False), max_size=3), max_size=2), ANY,
            "odd tools"))
        return out

    def request(self, odd: int | str = 2) -> st.SearchStrategy[Draft]:
        """A GenerateRequest map: some optional fields, up to `odd` of them (or the req_id, the
        type tag, the prompt, an unknown field) drawn odd; odd="one": exactly one, of any
        field (present for it); 0: none (a valid request)."""
        fields = self.fields()
        optional = sorted(set(fields) - {"req_id", "prompt", "input_ids", "messages",
                                         "max_new_tokens"})
        specials = ["req_id", "type", "source", "extra", "max_new_tokens"]

        @st.composite
        def draw_it(draw) -> Draft:
            present = ["max_new_tokens", *draw(st.lists(st.sampled_from(optional), unique=True,
                                                        max_size=6))]
            source = draw(st.sampled_from(["prompt", "input_ids", "messages"]))
            if odd == "one":
                targets = [draw(st.sampled_from(specials + optional))]
                present += [t for t in targets if t in optional and t not in present]
            else:
                targets = draw(st.lists(st.sampled_from(specials[:4] + present), unique=True,
                                        max_size=odd))
            body: dict[str, Any] = {}
            verdicts, notes = [], []

            def put(name: str, odd: bool) -> None:
                value, verdict, why = draw(fields[name][1] if odd else fields[name][0])
                body[name] = value
                verdicts.append(verdict)
                if verdict != OK:
                    notes.append(f"{name}={_short(value)}: {why}")

            tag_field, tag = tag_of(m.GenerateRequest)
            body[tag_field] = tag
            if "type" in targets:
                body[tag_field] = draw(st.sampled_from([99, -1, "1", None, 2]))
                verdicts.append(BAD)
                notes.append(f"type={body[tag_field]!r}")
            put("req_id", "req_id" in targets)
            how = draw(st.sampled_from(["odd", "none", "two"])) if "source" in targets else ""
            if how != "none":
                put(source, how == "odd")
            if how in ("none", "two"):
                if how == "two":
                    put(draw(st.sampled_from(sorted({"prompt", "input_ids", "messages"}
                                                    - {source}))), False)
                verdicts.append(BAD)
                notes.append("no prompt" if how == "none" else "two prompts")
            for name in present:
                put(name, name in targets)
            if "extra" in targets:
                body[draw(st.sampled_from(["prompts", "max_tokens", "n", "x"]))] = 1
                verdicts.append(BAD)
                notes.append("unknown field")
            if odd == 0 and _is_int(body.get("min_new_tokens")) \
                    and _is_int(body["max_new_tokens"]):  # a valid request was asked for
                body["min_new_tokens"] = min(body["min_new_tokens"], body["max_new_tokens"])
            self._semantics(body, verdicts, notes)
            return Draft("field" if odd == "one" else "schema", worst(*verdicts),
                         "; ".join(notes),
                         lambda rid, body=body: [pack(_fill(body, rid))])

        return draw_it()

    def _semantics(self, body: dict, verdicts: list[str], notes: list[str]) -> None:
        """Rules across fields: min <= max new tokens, a prompt within the context."""
        lo, hi = body.get("min_new_tokens", 0), body.get("max_new_tokens", 128)
        if _is_int(lo) and _is_int(hi) and lo > hi >= 1:
            verdicts.append(BAD)
            notes.append("min_new_tokens > max_new_tokens")
        if body.get("prompt") == "" and not body.get("input_ids") and not body.get("messages"):
            verdicts.append(BAD)
            notes.append("empty prompt")
        for key in ("input_ids", "messages"):
            if body.get(key) == [] and not body.get("prompt") and \
                    not body.get("messages" if key == "input_ids" else "input_ids"):
                verdicts.append(BAD)
                notes.append(f"empty {key}")
        ids = body.get("input_ids")
        if isinstance(ids, list) and len(ids) >= self.context:
            verdicts.append(BAD)
            notes.append("prompt beyond the context")

    def abort(self) -> st.SearchStrategy[Draft]:
        tag_field, tag = tag_of(m.AbortRequest)
        ok = st.builds(lambda s: {tag_field: tag, "req_id": Rid(s)}, st.text(max_size=4))
        odd = st.one_of(
            st.builds(lambda j: {tag_field: tag, "req_id": j}, self.junk({"str"}, False)),
            st.builds(lambda b: {tag_field: tag, "req_id": b}, self.bad_utf8()),
            st.just({tag_field: tag}),
            st.just({tag_field: tag, "req_id": Rid(), "prompt": "hi"}))
        return st.one_of(
            st.builds(lambda b: Draft("abort", OK, "", lambda rid: [pack(_fill(b, rid))]), ok),
            st.builds(lambda b: Draft("abort", BAD, "malformed abort",
                                      lambda rid: [pack(_fill(b, rid))]), odd))

    def frames(self) -> st.SearchStrategy[Draft]:
        """Wrong frame counts, empty frames, garbage."""
        valid = st.builds(lambda t: {"type": 1, "req_id": Rid(), "prompt": t,
                                     "max_new_tokens": 2}, self.text)

        return st.one_of(
            st.builds(lambda b, e: Draft("frames", BAD, f"{1 + len(e)} frames",
                                         lambda rid: [pack(_fill(b, rid)), *e]),
                      valid, st.lists(st.binary(max_size=8), min_size=1, max_size=3)),
            st.just(Draft("frames", BAD, "one empty frame", lambda rid: [b""])),
            st.builds(lambda n: Draft("frames", BAD, f"{n} empty frames",
                                      lambda rid: [b""] * n), st.integers(2, 4)),
            st.builds(lambda b: Draft("garbage", None, "random bytes", lambda rid: [b]),
                      st.binary(min_size=1, max_size=64)),
            st.builds(lambda v: Draft("garbage", None, "not a request",
                                      lambda rid: [pack(v)]),
                      st.one_of(self.junk({"map"}, False), st.dictionaries(
                          st.text(max_size=6), self.junk(set(), False), max_size=4))))

    def utf8(self) -> st.SearchStrategy[Draft]:
        """Invalid UTF-8 in one string: a field, a map key, a message, a stop string."""
        bad = self.bad_utf8()
        spots = {
            "req_id": lambda b: {"req_id": b, "prompt": "hi"},
            "prompt": lambda b: {"req_id": Rid(), "prompt": b},
            "role": lambda b: {"req_id": Rid(), "messages": [{"role": b, "content": "hi"}]},
            "content": lambda b: {"req_id": Rid(), "messages": [{"role": "user", "content": b}]},
            "key": lambda b: {"req_id": Rid(), "prompt": "hi", b: 1},
            "kwargs key": lambda b: {"req_id": Rid(), "messages": [{"role": "user",
                                                                    "content": "hi"}],
                                     "chat_template_kwargs": {b: True}},
            "stop": lambda b: {"req_id": Rid(), "prompt": "hi", "stop": [b]},
            "group": lambda b: {"req_id": Rid(), "prompt": "hi", "group": b},
        }

        def draft(spot: str, b: Str) -> Draft:
            body = {"type": 1, **spots[spot](b), "max_new_tokens": 2}
            return Draft("utf8", BAD, f"invalid UTF-8 in {spot}",
                         lambda rid: [pack(_fill(body, rid))])

        return st.builds(draft, st.sampled_from(sorted(spots)), bad)

    def deep(self) -> st.SearchStrategy[Draft]:
        """Nesting 10 to 100,000 levels deep: where a value may be anything ("any"), where it
        may not ("bad"), and as the whole frame."""

        def draft(depth: int, maps: bool, spot: str) -> Draft:
            deep = nest(depth, False, maps)
            body = {"type": 1, "req_id": Rid(), "max_new_tokens": 2,
                    "messages": [{"role": "user", "content": "hi"}]}
            if spot == "frame":
                return Draft("deep", BAD, f"frame nested {depth}", lambda rid: [deep.data])
            if spot == "chat_template_kwargs":
                body[spot] = {"a": deep}
                verdict = ANY
            else:
                body[spot] = deep
                verdict = BAD
            return Draft("deep", verdict, f"{spot} nested {depth} ({'maps' if maps else 'arrays'})",
                         lambda rid: [pack(_fill(body, rid))])

        return st.builds(draft, st.sampled_from([10, 65, 1000, 100_000]), st.booleans(),
                         st.sampled_from(["chat_template_kwargs", "chat_template_kwargs",
                                          "input_ids", "stop", "logit_bias", "frame"]))

    def huge(self) -> st.SearchStrategy[Draft]:
        """Long strings and lists, near and past the context, and huge max_new_tokens with a
        prompt that leaves room for only a few tokens (so it stays cheap)."""

        def prompt_draft(size: int) -> Draft:
            text = ("river stone " * (size // 12 + 1))[:size]
            verdict = OK if self.count_tokens(text) < self.context else BAD
            body = {"type": 1, "req_id": Rid(), "prompt": text, "max_new_tokens": 2}
            return Draft("huge", verdict, f"prompt of {size} chars",
                         lambda rid: [pack(_fill(body, rid))])

        limit = bounds_of(self.wire["max_new_tokens"].type)

        def edge_draft(short: int, max_new: int) -> Draft:
            n = self.context - short
            body = {"type": 1, "req_id": Rid(), "input_ids": [5] * n, "max_new_tokens": max_new}
            # Past the schema's bound: refused; an unbounded schema may take up to uint64.
            verdict = BAD if n >= self.context else OK if limit.holds(max_new) else \
                ANY if limit.hi is None else BAD
            return Draft("edge", verdict, f"{n} prompt ids, max_new_tokens={max_new}",
                         lambda rid: [pack(_fill(body, rid))])

        return st.one_of(
            st.builds(prompt_draft, st.sampled_from([2_000, 50_000, 1_000_000])),
            st.builds(edge_draft, st.sampled_from([-1, 0, 1, 2, 4]),
                      st.sampled_from([1, 8, 2**31, INT64_MAX, INT64_MAX + 1, UINT64_MAX])))

    def mutation(self) -> st.SearchStrategy[Draft]:
        base, other = self.request(odd=0), self.request()

        def draft(a: Draft, b: Draft, ops: list) -> Draft:
            def make(rid: str) -> list[bytes]:
                return [mutate(a.make(rid)[0], b.make(rid + "b")[0], ops)]
            return Draft("mutation", None, describe_ops(ops), make)

        return st.builds(draft, base, other, mutation_ops())

    def case(self) -> st.SearchStrategy[Draft]:
        kinds = {"schema": self.request(), "field": self.request("one"),
                 "abort": self.abort(), "frames": self.frames(), "utf8": self.utf8(),
                 "deep": self.deep(), "huge": self.huge(), "mutation": self.mutation()}
        weights = {"schema": 6, "field": 6, "abort": 1, "frames": 1, "utf8": 2, "deep": 1,
                   "huge": 1, "mutation": 3}
        return st.sampled_from([k for k, w in weights.items() for _ in range(w)]).flatmap(
            kinds.__getitem__)


def finish(d: Draft, index: int) -> Case | None:
    """A drawn frame with its req_id; what the server must do, from its bytes when the draft
    could not tell (mutations, garbage)."""
    frames = d.make(f"fz{index}-")
    case = Case("zmq", d.kind, d.verdict or BAD, d.note, frames=frames)
    if len(frames) != 1:
        return case
    case.req_id = claimed_req_id(frames[0])
    msg = decodes(frames[0], m.ClientInbound)
    case.expect_reply = not isinstance(msg, m.AbortRequest)
    if d.verdict is None and msg is not None:
        if isinstance(msg, m.GenerateRequest) and msg.max_new_tokens > MAX_MUTATED_TOKENS:
            return None
        case.verdict = ANY
    return case
