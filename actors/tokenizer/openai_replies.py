"""Replies -> OpenAI response and chunk objects (completions and chat), with usage and
logprobs in OpenAI's shapes (and vLLM's prompt_logprobs). Pure functions: no sockets, no
event loop. The request side: openai_format.py."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from actors.tokenizer.chat_output import finish_reason, whole_message
from protocol import messages as m


@dataclass
class Choice:
    index: int
    text: str
    finish_reason: str
    token_ids: list[int]
    logprobs: list[float]
    top_ids: list[list[int]]
    top_logprobs: list[list[float]]
    prompt: dict[str, Any] | None = None  # Finished's prompt_* fields (echo, prompt logprobs)


PROMPT_FIELDS = ("prompt_ids", "prompt_text", "prompt_logprobs", "prompt_top_ids",
                 "prompt_top_logprobs")


def prompt_of(reply: m.Delta | m.Finished) -> dict[str, Any] | None:
    return {name: getattr(reply, name) for name in PROMPT_FIELDS} if reply.prompt_ids else None


def choice_of(k: int, r: m.Finished, opts: dict[str, Any]) -> Choice:
    """A finished request as choice k; with max_tokens 0 (score_only) its one computed token
    is left out."""
    if opts.get("score_only"):
        return Choice(k, "", "length", [], [], [], [], prompt_of(r))
    return Choice(k, r.text, r.finish_reason, r.token_ids, r.logprobs, r.top_ids,
                  r.top_logprobs, prompt_of(r))


def _reason(reason: str | None) -> str | None:
    return {"abort": "stop", "error": "stop"}.get(reason, reason) if reason else None


def usage(results: list[m.Finished], n: int = 1, score_only: bool = False) -> dict[str, Any]:
    """Summed over the request's prompts (each counted once, not once per choice)."""
    prompt = sum(r.prompt_tokens for r in results[::n])
    completion = 0 if score_only else sum(r.completion_tokens for r in results)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": max((r.cached_tokens for r in results),
                                                           default=0)}}


def _chat_logprobs(ids, lps, top_ids, top_lps, text: Callable[[int], str]) -> dict[str, Any]:
    def entry(i: int, lp: float) -> dict[str, Any]:
        t = text(i)
        return {"token": t, "logprob": lp, "bytes": list(t.encode("utf-8"))}
    return {"content": [{**entry(i, lp), "top_logprobs": [entry(a, b) for a, b in zip(ti, tl)]}
                        for i, lp, ti, tl in zip(ids, lps, top_ids or [[]] * len(ids),
                                                 top_lps or [[]] * len(ids))]}


def _completion_logprobs(ids, lps, top_ids, top_lps, text: Callable[[int], str],
                         k: int | None = None) -> dict:
    """OpenAI's legacy logprobs: per token its text, logprob (None: not scored, the prompt's
    first) and a map of the k best alternatives (None where not scored)."""
    n = len(ids)
    tops = [None if lp is None else {text(a): b for a, b in zip(ti[:k], tl[:k])}
            for lp, ti, tl in zip(lps, top_ids or [[]] * n, top_lps or [[]] * n)]
    return {"tokens": [text(i) for i in ids], "token_logprobs": list(lps),
            "top_logprobs": tops, "text_offset": _offsets(ids, text)}


def _offsets(ids: list[int], text: Callable[[int], str]) -> list[int]:
    at, out = 0, []
    for i in ids:
        out.append(at)
        at += len(text(i))
    return out


def _prompt_logprobs(prompt: dict[str, Any], k: int, text: Callable[[int], str]) -> list:
    """vLLM's prompt_logprobs: per prompt position None (the first) or {token id: {logprob,
    rank, decoded_token}} for the prompt's token and its k best alternatives."""
    out: list[Any] = []
    for tid, lp, ti, tl in zip(prompt["prompt_ids"], prompt["prompt_logprobs"],
                               prompt["prompt_top_ids"], prompt["prompt_top_logprobs"]):
        if lp is None:
            out.append(None)
            continue
        entry = {str(a): {"logprob": b, "rank": r + 1, "decoded_token": text(a)}
                 for r, (a, b) in enumerate(zip(ti[:k], tl[:k]))}
        if str(tid) not in entry:
            entry[str(tid)] = {"logprob": lp, "rank": 1 + sum(1 for b in tl if b > lp),
                               "decoded_token": text(tid)}
        out.append(entry)
    return out


def _echoed(c: Choice, opts: dict[str, Any]) -> tuple[str, list, list, list, list]:
    """The choice's text and logprob columns, the prompt's first where echo is asked."""
    p = c.prompt if opts.get("echo") else None
    n = len(c.token_ids)
    ids, lps = list(c.token_ids), list(c.logprobs)
    tids, tlps = list(c.top_ids or [[]] * n), list(c.top_logprobs or [[]] * n)
    if p is None:
        return c.text, ids, lps, tids, tlps
    length = len(p["prompt_ids"])
    scored = bool(p["prompt_logprobs"])
    return (p["prompt_text"] + c.text, p["prompt_ids"] + ids,
            (p["prompt_logprobs"] if scored else [None] * length) + lps,
            (p["prompt_top_ids"] if scored else [[]] * length) + tids,
            (p["prompt_top_logprobs"] if scored else [[]] * length) + tlps)


def _completion_choice(c: Choice, opts: dict[str, Any], logprobs: bool) -> dict[str, Any]:
    text = opts["token_text"]
    body, ids, lps, tids, tlps = _echoed(c, opts)
    out = {"index": c.index, "text": body, "finish_reason": _reason(c.finish_reason),
           "logprobs": _completion_logprobs(ids, lps, tids, tlps, text, opts.get("top"))
           if logprobs else None}
    if opts.get("prompt_logprobs") is not None and c.prompt is not None:
        out["prompt_logprobs"] = _prompt_logprobs(c.prompt, opts["prompt_logprobs"], text)
    return out


def completion_response(rid, created, model, choices: list[Choice], use, opts) -> dict:
    return {"id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": [_completion_choice(c, opts, opts["logprobs"]) for c in choices],
            "usage": use}


def completion_chunk(rid, created, model, k, text, reason, lp, opts,
                     prompt: dict[str, Any] | None = None) -> dict:
    """One streamed piece of choice k; `prompt` (on the choice's first piece, with echo or
    prompt logprobs) goes before the piece."""
    ids, lps, tids, tlps = lp if lp is not None else ([], [], [], [])
    c = Choice(k, text, reason or "", list(ids), list(lps), list(tids or []),
               list(tlps or []), prompt)
    logprobs = opts["logprobs"] and (lp is not None or (prompt is not None and opts.get("echo")))
    choice = _completion_choice(c, opts, logprobs)
    choice["finish_reason"] = _reason(reason)
    return {"id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": [choice]}


def chat_response(rid, created, model, choices: list[Choice], use, opts) -> dict:
    text = opts["token_text"]
    out = []
    for c in choices:
        message, called = whole_message(c.text, reasoning=True, tools=opts.get("tools", False))
        out.append({"index": c.index, "message": message,
                    "finish_reason": _reason(finish_reason(c.finish_reason, called)),
                    "logprobs": _chat_logprobs(c.token_ids, c.logprobs, c.top_ids,
                                               c.top_logprobs, text)
                    if opts["logprobs"] else None})
    return {"id": rid, "object": "chat.completion", "created": created, "model": model,
            "choices": out, "usage": use}


def chat_chunk(rid, created, model, k, delta: dict[str, Any], reason, lp, opts) -> dict:
    """delta: the chunk's delta fields (role, content, reasoning_content, tool_calls)."""
    logprobs = (_chat_logprobs(*lp, opts["token_text"])
                if lp is not None and opts["logprobs"] else None)
    return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
            "choices": [{"index": k, "delta": delta, "finish_reason": _reason(reason),
                         "logprobs": logprobs}]}
