"""What a constrained request may ask for, and its compilation by llguidance: the one place
both the tokenizer (which refuses what does not compile before the request is queued) and the
runner (which masks with it) read. No MLX here: the tokenizer process never loads it.

Kinds, by sglang's names: a JSON schema (`{"type": "object"}` for any JSON object), a regular
expression, an EBNF grammar
(llguidance's Lark syntax, or llama.cpp's GBNF, converted), and a structural tag (free text in
which each trigger starts a call whose body follows a schema).
"""

from __future__ import annotations

import json
from functools import lru_cache

import llguidance
from llguidance.gbnf_to_lark import any_to_lark

KINDS = ("json_schema", "regex", "ebnf", "structural_tag")  # any JSON object: a schema too


class GrammarError(ValueError):
    """A constraint the grammar library refuses, with its reason."""


# No free whitespace between JSON tokens (a schema's "x-guidance" may ask for it): a model that
# likes spaces, or a random one, would otherwise pad forever; separators as json.dumps writes.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def _json(source: str, what: str):
    try:
        return json.loads(source)
    except ValueError as e:
        raise GrammarError(f"{what} is not JSON: {e}") from None


def lark_text(text: str, specials: frozenset[str]) -> str:
    """A literal in a Lark rule: a special token by its name (a model writes `<tool_call>` as
    one token, never as the characters), any other text quoted."""
    return text if text in specials else json.dumps(text)


def structural_tag_lark(tag: dict, specials: frozenset[str]) -> str:
    """sglang's structural tag ({"structures": [{"begin", "schema", "end"}], "triggers": [...]})
    as a Lark grammar: any text, in which a trigger starts one of the structures that begin
    with it, whose body then follows its schema up to its end."""
    if not isinstance(tag, dict) or not isinstance(tag.get("structures"), list) \
            or not isinstance(tag.get("triggers"), list) or not tag["triggers"]:
        raise GrammarError("structural_tag needs a list of structures and of triggers")
    rules = []
    for k, s in enumerate(tag["structures"]):
        if not isinstance(s, dict) or not all(isinstance(s.get(key), str)
                                              for key in ("begin", "end")):
            raise GrammarError("structural_tag: each structure needs a begin and an end string")
        trigger = next((t for t in tag["triggers"]
                        if isinstance(t, str) and t and s["begin"].startswith(t)), None)
        if trigger is None:
            raise GrammarError(f"structural_tag: no trigger starts begin {s['begin'][:40]!r}")
        schema = json.dumps(s.get("schema") or {})
        rest = s["begin"][len(trigger):]
        body = " ".join(x for x in (lark_text(rest, specials) if rest else "",
                                    f"%json {schema}",
                                    lark_text(s["end"], specials) if s["end"] else "") if x)
        if trigger in specials:  # a special token cannot be the end of free text by chance
            rules.append(f"call_{k}: TEXT {trigger} {body}")
        else:  # free text up to the first place the trigger appears: a lazy lexeme
            rules.append(f"call_{k}_head[lazy]: TEXT {json.dumps(trigger)}\n"
                         f"call_{k}: call_{k}_head {body}")
    if not rules:
        raise GrammarError("structural_tag: no structures")
    calls = " | ".join(f"call_{k}" for k in range(len(rules)))
    return "\n".join(["%llguidance {}", f"start: ({calls})* TEXT", r"TEXT: /(.|\n)*/", *rules])


def _grammar(kind: str, source: str, specials: frozenset[str]) -> str:
    match kind:
        case "json_schema":
            if not isinstance(_json(source, "json_schema"), dict):
                raise GrammarError("json_schema must be a JSON object")
            return llguidance.LLMatcher.grammar_from_json_schema(source, defaults=JSON_OPTIONS)
        case "regex":
            return llguidance.LLMatcher.grammar_from_regex(source)
        case "ebnf":
            return llguidance.LLMatcher.grammar_from_lark(any_to_lark(source))
        case "structural_tag":
            lark = structural_tag_lark(_json(source, "structural_tag"), specials)
            return llguidance.LLMatcher.grammar_from_lark(lark)
    raise GrammarError(f"unknown constraint kind {kind!r} (one of {', '.join(KINDS)})")


@lru_cache(maxsize=256)
def compile_constraint(kind: str, source: str, specials: frozenset[str] = frozenset()) -> str:
    """The llguidance grammar of a constraint, checked; cached by its arguments. `specials`:
    the tokenizer's special tokens, which literals of a structural tag name as tokens.
    GrammarError names what the library refused. The grammar is what travels to the runner,
    which builds its matchers from it."""
    try:
        grammar = _grammar(kind, source, specials)
    except GrammarError:
        raise
    except Exception as e:  # whatever the library raises, the input is what it refused
        raise GrammarError(f"{kind} refused: {e}") from None
    message = llguidance.LLMatcher.validate_grammar(grammar, None)
    if message and not message.startswith("WARNING"):
        raise GrammarError(f"{kind} refused: {message}")
    return grammar
