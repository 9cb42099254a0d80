"""HTTP bodies for the fuzz job (tools/fuzz/job.py): /v1/completions and
/v1/chat/completions bodies drawn from the OpenAI body schemas (actors/tokenizer/openai_format.py),
their ranges checked against the wire schema's (GenerateRequest) and OpenAI's documented ones;
chat content parts of every type; bodies wrong as a whole (not JSON, not an object, nested
100,000 deep, not UTF-8, lone surrogates, megabytes long), on the agents' /v1/messages and
/v1/responses too; byte mutations of valid bodies."""

from __future__ import annotations

from hypothesis import strategies as st

from actors.tokenizer import openai_format as oa
from tools.fuzz.cases import (ANY, BAD, MAX_MUTATED_TOKENS, MAX_NEW, OK, WIRE_NAME,
                                   Case, Draft, V, Values, _is_int, _same, _short, _v,
                                   describe_ops, mutate, mutation_ops, worst)
from tools.fuzz.wire import (INT64_MAX, Raw, bounds_of, fields_of, nest, parses_json,
                                  plain_type, to_json)


class Bodies(Values):
    """Strategies of HTTP bodies (Drafts); `case()` is the mix the job sends."""

    def fields(self, body_type: type) -> dict[str, tuple]:
        """(ok, odd) per OpenAI body field: types from the body schema, ranges also from the
        wire field it becomes (top_k -1 is OpenAI's "off": 0 on the wire)."""
        out, known = {}, fields_of(body_type)
        for name, f in known.items():
            wire = WIRE_NAME.get(name, name)
            if name == "logprobs" and bounds_of(plain_type(f.type)[0]) is None:
                wire = name  # chat: a bool
            extra = []
            if wire in self.wire and bounds_of(self.wire[wire].type):
                move = (lambda v: max(v, 0)) if name == "top_k" else _same
                extra = [(bounds_of(self.wire[wire].type), move)]
            out[name] = self.generic(f.type, name, True, extra)
        tid = st.integers(0, self.vocab - 1)
        out["stop"] = (st.one_of(_v(st.none(), OK), _v(self.text, OK),
                                 _v(st.lists(self.text, max_size=3), OK)),
                       st.one_of(self.stop_odd(True), _v(st.just(""), BAD, "empty stop")))
        out["logit_bias"] = (_v(st.dictionaries(tid.map(str), st.floats(-100, 100), max_size=4),
                                OK), self.bias_odd(True))
        out["stop_token_ids"] = (_v(st.lists(tid, max_size=3), OK), _v(
            st.lists(st.sampled_from([-1, self.vocab, 2**31, 2**64]), min_size=1, max_size=2),
            BAD, "id outside vocab"))
        out["stream_options"] = (_v(st.one_of(st.none(), st.builds(
            lambda b: {"include_usage": b}, st.booleans())), OK),
            out.get("stream_options", (None, st.nothing()))[1])
        out["chat_template_kwargs"] = (_v(st.one_of(st.none(), st.builds(
            lambda b: {"enable_thinking": b}, st.booleans())), OK), st.one_of(
            out.get("chat_template_kwargs", (None, st.nothing()))[1],
            _v(st.sampled_from([10, 65, 1000, 5000]).map(lambda d: {"a": nest(d, True, False)}),
               ANY, "deep value")))
        # echo is served (the prompt before the completion): either bool is valid.
        out["echo"] = (_v(st.booleans(), OK), out.get("echo", (None, st.nothing()))[1])
        # Constraints and tools: none, or anything (they compile or are a 400 naming them).
        odd_format = st.sampled_from([{"type": "yaml"}, {"type": "json_object"},
                                      {"type": "json_schema"}, {"json_schema": {}},
                                      {"type": "json_schema", "json_schema": {"schema": 5}}])
        out["response_format"] = (_v(st.none(), OK), _v(odd_format, ANY, "odd format"))
        for name in ("regex", "ebnf"):
            out[name] = (_v(st.none(), OK), _v(self.text, ANY, f"odd {name}"))
        out["tools"] = (_v(st.none(), OK), _v(st.sampled_from(
            [[{"type": "function"}], [{"type": "x", "function": {"name": "f"}}], [5], {}]), ANY,
            "odd tools"))
        out["tool_choice"] = (_v(st.none(), OK), _v(st.sampled_from(
            ["auto", "none", "required", "any", {"type": "function"}, 7]), ANY, "odd choice"))
        out["parallel_tool_calls"] = (_v(st.booleans(), OK),
                                      _v(st.just("yes"), BAD, "not a bool"))
        out["prompt"] = self.prompt()
        out["messages"] = (self.messages(True), st.one_of(self.messages_odd(True), self.parts()))
        return {name: v for name, v in out.items() if name in known}  # one body's fields

    def prompt(self) -> tuple:
        # Several prompts (strings or token-id lists) in one body are served.
        ok = st.one_of(self.text, st.builds(lambda t: [t], self.text), self.ids,
                       st.sampled_from([["a", "b"], [[1, 2]]]))
        odd = st.one_of(
            _v(st.sampled_from([[], "", [1.5], [True], None]), BAD,
               "not a prompt"),
            _v(st.lists(st.sampled_from([-1, self.vocab, 2**40]), min_size=1, max_size=2), BAD,
               "id outside vocab"),
            _v(st.just("\ud800 hi"), ANY, "lone surrogate"))
        return _v(ok, OK), odd

    def parts(self) -> st.SearchStrategy[V]:
        """Chat content as parts, with the part's text of every type."""
        part = st.one_of(
            _v(st.builds(lambda t: {"type": "text", "text": t}, self.text), OK),
            _v(st.sampled_from([{"type": "text", "text": 5}, {"type": "text", "text": [1]},
                                {"type": "text", "text": {"a": 1}}, "just text", 7]), BAD,
               "bad part"),
            _v(st.sampled_from([{"type": "text", "text": None}, {"type": "text"},
                                {"text": "no type"}, {"type": "image_url",
                                                      "image_url": {"url": "x"}}]), ANY,
               "odd part"))

        def msgs(drawn: list[V]) -> V:
            parts = [p for p, _, _ in drawn]
            return ([{"role": "user", "content": parts}], worst(*[v for _, v, _ in drawn]),
                    "content parts " + _short(parts))

        return st.lists(part, min_size=1, max_size=3).map(msgs)

    def request(self, chat: bool, odd: int | str = 2) -> st.SearchStrategy[Draft]:
        """An OpenAI body, its fields drawn as zmq_generate draws a request's."""
        body_type = oa.ChatBody if chat else oa.CompletionBody
        fields = self.fields(body_type)
        source = "messages" if chat else "prompt"
        optional = sorted(set(fields) - {source, "max_tokens", "max_completion_tokens"})

        @st.composite
        def draw_it(draw) -> Draft:
            present = draw(st.lists(st.sampled_from(optional), unique=True, max_size=6))
            cap = draw(st.sampled_from(["max_tokens", "max_completion_tokens"] if chat
                                       else ["max_tokens"]))
            if odd == "one":
                targets = [draw(st.sampled_from([source, cap, "extra", *optional]))]
                present += [t for t in targets if t in optional and t not in present]
            else:
                targets = draw(st.lists(st.sampled_from([source, cap, "extra", *present]),
                                        unique=True, max_size=odd))
            body, verdicts, notes = {}, [], []
            for name in [source, cap, *present]:
                value, verdict, why = draw(fields[name][1] if name in targets
                                           else fields[name][0])
                body[name] = value
                verdicts.append(verdict)
                if verdict != OK:
                    notes.append(f"{name}={_short(value)}: {why}")
            if "extra" in targets:  # unknown fields are ignored, however deep
                body["user"] = draw(st.one_of(self.text, st.sampled_from(
                    [10, 100, 1000, 5000]).map(lambda d: nest(d, True, True))))
                deep = isinstance(body["user"], Raw)
                verdicts.append(ANY if deep else OK)
                notes.append("deep unused field" if deep else "unused field")
            self._semantics(body, chat, verdicts, notes, fix=not odd)
            path = "/v1/chat/completions" if chat else "/v1/completions"
            data = to_json(body)
            kind = ("chat" if chat else "completion") + ("-field" if odd == "one" else "")
            return Draft(kind, worst(*verdicts), "; ".join(notes), lambda rid: data, path)

        return draw_it()

    def _semantics(self, body: dict, chat: bool, verdicts: list, notes: list,
                   fix: bool = False) -> None:
        """Cost and rules across fields: a chat body without a token cap would generate up to
        the context; min_tokens <= the cap; the seed of the n-th choice still fits. fix: the
        body must stay valid (odd=0): a min_tokens above the cap is lowered to it."""
        caps = [body.get(k) for k in ("max_completion_tokens", "max_tokens") if k in body]
        if chat and all(c is None for c in caps):
            body["max_completion_tokens"] = MAX_NEW
        cap = next((c for c in caps if c is not None), MAX_NEW if chat else 16)
        lo = body.get("min_tokens", 0)
        if _is_int(lo) and _is_int(cap) and lo > cap >= 1 and fix:
            body["min_tokens"] = cap
        elif _is_int(lo) and _is_int(cap) and lo > cap >= 1:
            verdicts.append(BAD)
            notes.append("min_tokens > max tokens")
        n, s = body.get("n", 1), body.get("seed")
        if _is_int(n) and _is_int(s) and 0 <= s <= INT64_MAX < s + n - 1:
            verdicts.append(ANY)
            notes.append("seed + n overflows int64")

    def whole(self) -> st.SearchStrategy[Draft]:
        """Bodies that are wrong as a whole: not JSON, not an object, deep, not UTF-8, huge."""
        # The agents' endpoints take the same wholly wrong bodies.
        path = st.sampled_from(["/v1/completions", "/v1/chat/completions", "/v1/messages",
                                "/v1/responses"])
        ok_body = to_json({"prompt": "hi", "max_tokens": 2})

        def raw(kind: str, verdict: str, note: str, data: bytes, p: str) -> Draft:
            return Draft(kind, verdict, note, lambda rid: data, p)

        def huge(size: int, p: str) -> Draft:
            text = ("stone river " * (size // 12 + 1))[:size]
            key = "prompt" if p == "/v1/completions" else "messages"
            value = [{"role": "user", "content": text}] if key == "messages" else text
            count = self.count_tokens(text)
            verdict = BAD if count >= self.context else OK if count + 64 < self.context else ANY
            body = {key: value, "max_tokens": 2}
            if p == "/v1/messages":
                body["model"] = "any"
            elif p == "/v1/responses":
                body = {"input": text, "max_output_tokens": 2}
            return raw("huge", verdict, f"{key} of {size} chars", to_json(body), p)

        return st.one_of(
            st.builds(lambda b, p: raw("not_json", BAD, "random bytes", b, p),
                      st.binary(max_size=40).filter(lambda b: not parses_json(b)[0]), path),
            st.builds(lambda k, p: raw("not_json", BAD, f"cut at {k}", ok_body[:k], p),
                      st.integers(0, len(ok_body) - 1), path),
            st.builds(lambda v, p: raw("not_object", BAD, "not an object", to_json(v), p),
                      st.one_of(st.lists(st.integers(), max_size=3), st.text(max_size=5),
                                st.integers(), st.none(), st.booleans()), path),
            st.builds(lambda d, maps, p: raw("deep", BAD, f"body nested {d}",
                                              nest(d, True, maps).data, p),
                      st.sampled_from([100, 1000, 5000, 100_000]), st.booleans(), path),
            st.builds(lambda d, p: raw("deep", BAD, f"prompt nested {d}", to_json(
                {"prompt": nest(d, True, False), "messages": nest(d, True, False),
                 "max_tokens": 2}), p), st.sampled_from([10, 1000, 5000]), path),
            st.builds(lambda s, p: raw("utf8", BAD, "invalid UTF-8 in a string", to_json(
                {"prompt": s, "messages": [{"role": "user", "content": s}], "max_tokens": 2}), p),
                self.bad_utf8(), path),
            st.builds(lambda s, p: raw("utf8", ANY, "lone surrogate in a string", to_json(
                {"prompt": s, "messages": [{"role": s, "content": s}], "stop": [s],
                 "max_tokens": 2}), p), st.sampled_from(["\ud800", "a\udfff", "\udc80\ud800"]),
                path),
            st.builds(huge, st.sampled_from([5_000, 200_000, 2_000_000]), path))

    def mutation(self) -> st.SearchStrategy[Draft]:
        base = st.one_of(self.request(False, odd=0), self.request(True, odd=0))

        def draft(a: Draft, b: Draft, ops: list) -> Draft:
            data = mutate(a.make(""), b.make(""), ops)
            return Draft("mutation", None, describe_ops(ops), lambda rid: data, a.path)

        return st.builds(draft, base, base, mutation_ops())

    def case(self) -> st.SearchStrategy[Draft]:
        kinds = {"completion": self.request(False), "chat": self.request(True),
                 "completion-field": self.request(False, "one"),
                 "chat-field": self.request(True, "one"), "whole": self.whole(),
                 "mutation": self.mutation()}
        weights = {"completion": 2, "chat": 2, "completion-field": 2, "chat-field": 2,
                   "whole": 3, "mutation": 2}
        return st.sampled_from([k for k, w in weights.items() for _ in range(w)]).flatmap(
            kinds.__getitem__)


def finish(d: Draft, index: int) -> Case | None:
    """A drawn body; what the server must do, from its bytes when the draft could not tell."""
    body = d.make("")
    case = Case("http", d.kind, d.verdict or BAD, d.note, path=d.path, body=body)
    if d.verdict is None:
        parsed, value = parses_json(body)
        if isinstance(value, dict):
            cap = value.get("max_completion_tokens") or value.get("max_tokens") or (
                4096 if "chat" in d.path else 16)
            n = value.get("n", 1)
            if not (_is_int(cap) and _is_int(n)) or cap > MAX_MUTATED_TOKENS or n > 4:
                return None
        case.verdict = ANY if parsed and isinstance(value, dict) else BAD
    return case
