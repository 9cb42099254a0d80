"""Constrained decoding's core (actors/model_runner/grammar.py) on the real Qwen tokenizer:
whatever the logits, a row sampled through its masks ends in text the constraint accepts;
constraints the library refuses are named errors."""

from __future__ import annotations

import json
import re

import jsonschema
import llguidance
import mlx.core as mx
import numpy as np
import pytest

from actors.constraints import GrammarError, compile_constraint
from actors.model_runner.grammar import Grammars, RowMatchers, allowed, apply_masks
from models.builtin import ensure_builtin
from tests.support.schemas import SCHEMAS
from models.info import read_model_info

@pytest.fixture(scope="module")
def grammars(model_cache):
    path = ensure_builtin("qwen3-tiny", cache_dir=model_cache, progress=False)
    info = read_model_info(str(path))
    return Grammars((path / "tokenizer.json").read_text(), info.vocab_size, info.eos_ids[0])


TOOL_TAGS = frozenset({"<tool_call>", "</tool_call>"})


def _sample(grammars: Grammars, constraint: tuple[str, str], seed: int, limit: int = 400) -> str:
    """Random logits, masked, argmax, until the matcher stops: the text it let through."""
    rng = np.random.default_rng(seed)
    m = grammars.matcher(compile_constraint(*constraint))
    eos = grammars.tokenizer.eos_token
    ids = []
    for _ in range(limit):
        logits = mx.array(rng.normal(size=(1, grammars.vocab_size)).astype(np.float32))
        token = int(mx.argmax(apply_masks(logits, grammars.masks([m])), axis=-1).item())
        if token == eos:
            assert m.is_accepting()
            break
        assert m.consume_token(token), m.get_error()
        ids.append(token)
        if m.is_stopped():
            break
    else:
        pytest.fail(f"no end in {limit} tokens: {grammars.tokenizer.decode_str(ids)!r}")
    return grammars.tokenizer.decode_str(ids)


@pytest.mark.parametrize("schema", SCHEMAS)
def test_json_schema_rows_end_in_json_that_validates(grammars, schema):
    for seed in range(3):
        text = _sample(grammars, ("json_schema", json.dumps(schema)), seed)
        jsonschema.validate(json.loads(text), schema)


def test_json_object_and_regex_rows_end_in_what_they_ask_for(grammars):
    assert isinstance(json.loads(_sample(grammars, ("json_schema", '{"type": "object"}'), 1,
                                         limit=2000)), dict)
    pattern = r"(yes|no), [0-9]{3}"
    assert re.fullmatch(pattern, _sample(grammars, ("regex", pattern), 2))


def test_masks_forbid_exactly_the_tokens_whose_bit_is_clear(grammars):
    m = grammars.matcher(compile_constraint("regex", "[0-9]+"))
    bitmask = grammars.masks([m])
    bits = np.unpackbits(bitmask.view(np.uint8), bitorder="little")[:grammars.vocab_size]
    keep = np.array(allowed(bitmask, grammars.vocab_size))[0]
    np.testing.assert_array_equal(keep, bits.astype(bool))
    assert 0 < keep.sum() < grammars.vocab_size // 10  # digits only
    digit = grammars.tokenizer.tokenize_str("7")[0]
    letter = grammars.tokenizer.tokenize_str("a")[0]
    assert keep[digit] and not keep[letter]
    out = np.array(apply_masks(mx.zeros((1, grammars.vocab_size)), bitmask))[0]
    assert np.all(out[keep] == 0) and np.all(np.isneginf(out[~keep]))


@pytest.mark.parametrize("grammar", [
    'root ::= ("yes" | "no") ", " [0-9] [0-9] [0-9]',  # GBNF, as llama.cpp writes it
    'start: ("yes" | "no") ", " /[0-9]{3}/',  # llguidance's Lark
])
def test_ebnf_rows_end_in_what_the_grammar_derives(grammars, grammar):
    for seed in range(3):
        assert re.fullmatch(r"(yes|no), [0-9]{3}",
                            _sample(grammars, ("ebnf", grammar), seed))


def test_structural_tag_rows_keep_each_triggered_call_to_its_schema(grammars):
    """Free text, where each `<tool_call>` begins a body that follows the schema."""
    schema = {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}},
              "required": ["city"], "additionalProperties": False}
    tag = {"structures": [{"begin": "<tool_call>", "schema": schema, "end": "</tool_call>"}],
           "triggers": ["<tool_call>"]}
    grammar = compile_constraint("structural_tag", json.dumps(tag), TOOL_TAGS)
    m = llguidance.LLMatcher(grammars.tokenizer, grammar)
    text = grammars.tokenizer.tokenize_str
    special = grammars.tokenizer.tokenize_str("<tool_call>", parse_special=True)
    assert len(special) == 1
    for t in text("Let me look. "):
        assert m.consume_token(t), m.get_error()
    assert m.consume_token(special[0])
    keep = np.array(allowed(grammars.masks([m]), grammars.vocab_size))[0]
    assert keep[text("{")[0]] and not keep[text("Hello")[0]]
    body = text('{"city": "Oslo"}')
    for t in body:
        assert m.consume_token(t), m.get_error()
    end = grammars.tokenizer.tokenize_str("</tool_call>", parse_special=True)
    assert m.consume_token(end[0]), m.get_error()
    assert m.is_accepting()


@pytest.mark.parametrize("kind,source,reason", [
    ("json_schema", "{not json", "not JSON"),
    ("json_schema", '{"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}', "refused"),
    ("regex", "(unclosed", "refused"),
    ("ebnf", "start: undefined_rule", "refused"),
    ("ebnf", "root ::= (", "refused"),
    ("structural_tag", '{"structures": [{"begin": "<f>", "end": "</f>"}], "triggers": ["<g"]}',
     "no trigger starts"),
    ("json_schema", "[1, 2]", "must be a JSON object"),
    ("xml", "", "unknown constraint kind"),
])
def test_constraints_the_library_refuses_are_named(grammars, kind, source, reason):
    with pytest.raises(GrammarError, match=reason):
        compile_constraint(kind, source)
        grammars.matcher(compile_constraint(kind, source))


def test_the_tokenizer_is_built_at_the_first_constrained_row_only(grammars):
    """A runner that never sees a constrained request never builds the grammar tokenizer
    (~240 MB on the Qwen vocabulary); the first constrained row builds it, once."""
    built = []

    def load():
        built.append(1)
        return grammars

    rows = RowMatchers(load)
    rows.drew([0, 1], mx.array([5, 6]))  # steps without constrained rows
    assert built == []
    rows.admit(0, compile_constraint("regex", "[ab]+"))
    rows.admit(1, compile_constraint("regex", "c+"))
    eos = grammars.tokenizer.eos_token
    masks = rows.next_masks([0, 1], [[eos], [eos]])
    assert built == [1] and masks.shape[0] == 2
