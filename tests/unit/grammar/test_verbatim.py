"""Verbatim extraction: plain string values can only be spans of the document."""

from __future__ import annotations

import json

import pytest

from structspec.engine.engine import Request
from structspec.options import STRATEGIES, RequestOptions
from structspec.grammar import GrammarCache, SchemaError, check_schema, make_backend
from structspec.grammar.verbatim import KEY, uses_verbatim
from tests.conftest import deepjsoneval_rows

TRICKY = 'He said "hi" \\ then\nleft.\tCafé 東京 — 5 €\r\nEnd'
# `make test` checks the 50 documents in the default (flexible) layout; the compact one in
# `make test-long` (tests/conftest.py)
LONG_PARAMS = {"test_every_string_is_a_document_span_on_50_documents": {"whitespace": "compact"}}
SCHEMA = {"type": "object",
          "properties": {"quote": {"type": "string"}, "note": {"type": "string", KEY: False},
                         "n": {"type": "number"}, "kind": {"enum": ["a", "b"]},
                         "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 3}},
          "required": ["quote", "note", "n", "kind"]}


@pytest.fixture(scope="module")
def grammars(tokenizer):
    return GrammarCache(make_backend("llguidance", tokenizer))  # flexible whitespace, the default


@pytest.fixture(scope="module")
def compact_grammars(tokenizer):
    return GrammarCache(make_backend("llguidance", tokenizer, whitespace="compact"))


def accepts(grammars, tokenizer, schema, document, text, verbatim=True) -> bool:
    m = grammars.get_for(schema, document, verbatim).matcher()
    return m.consume(tokenizer.encode(text, add_special_tokens=False)) and m.is_accepting()


def strings_of(value):
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from strings_of(v)
    elif isinstance(value, list):
        for v in value:
            yield from strings_of(v)


@pytest.mark.parametrize("span", ['He said "hi" \\ then\nleft.', "Café 東京 — 5 €", "\tCafé", "\r\nEnd", "", "hi"])
def test_escaped_spans_of_the_document_round_trip(grammars, tokenizer, span):
    out = {"quote": span, "note": "x", "n": 1, "kind": "a"}
    text = json.dumps(out, ensure_ascii=False, separators=(",", ":"))
    assert accepts(grammars, tokenizer, SCHEMA, TRICKY, text)
    assert json.loads(text)["quote"] in TRICKY


@pytest.mark.parametrize("value", ["He said hi", "Cafe", "then\\nleft", "東京東京", "End.", "e said"])
def test_values_that_are_not_spans_are_refused(grammars, tokenizer, value):
    # includes a span that starts mid-word ("e said"): spans start and end on word boundaries
    text = json.dumps({"quote": value, "note": "x", "n": 1, "kind": "a"}, ensure_ascii=False, separators=(",", ":"))
    assert not accepts(grammars, tokenizer, SCHEMA, TRICKY, text)
    assert accepts(grammars, tokenizer, SCHEMA, TRICKY, text, verbatim=False)  # free mode takes it


def test_mixed_fields_keep_their_own_grammar(grammars, compact_grammars, tokenizer):
    base = {"quote": "left.", "note": "anything at all", "n": 2.5, "kind": "b", "tags": ["Café", "End"]}
    text = json.dumps(base, ensure_ascii=False, separators=(",", ":"))
    assert accepts(grammars, tokenizer, SCHEMA, TRICKY, text)  # `note` is free, tags are spans
    for bad in ({**base, "tags": ["nope"]}, {**base, "kind": "c"}, {**base, "tags": ["a", "b", "c", "d"]}):
        assert not accepts(grammars, tokenizer, SCHEMA, TRICKY, json.dumps(bad, separators=(",", ":")))
    # the whitespace the plain grammar allows: any gap in flexible mode, none in compact mode
    pretty = json.dumps(base, ensure_ascii=False, indent=2)
    assert accepts(grammars, tokenizer, SCHEMA, TRICKY, pretty)
    assert accepts(grammars, tokenizer, SCHEMA, TRICKY, pretty.replace('": ', '" : '))  # a gap before a colon too
    assert accepts(compact_grammars, tokenizer, SCHEMA, TRICKY, text)
    assert not accepts(compact_grammars, tokenizer, SCHEMA, TRICKY, pretty)
    assert not accepts(compact_grammars, tokenizer, SCHEMA, TRICKY, text.replace(",", ", "))
    missing = {k: v for k, v in base.items() if k != "quote"}  # a required verbatim field
    assert not accepts(grammars, tokenizer, SCHEMA, TRICKY, json.dumps(missing, separators=(",", ":")))
    optional_left_out = {k: v for k, v in base.items() if k != "tags"}
    assert accepts(grammars, tokenizer, SCHEMA, TRICKY,
                   json.dumps(optional_left_out, ensure_ascii=False, separators=(",", ":")))


def test_annotation_on_a_subtree_turns_verbatim_on_without_the_request_option(grammars, tokenizer):
    schema = {"type": "object", "properties": {"who": {"type": "object", KEY: True,
                                                       "properties": {"name": {"type": "string"}}}},
              "required": ["who"]}
    assert uses_verbatim(schema, False) and not uses_verbatim({"type": "string"}, False)
    assert accepts(grammars, tokenizer, schema, TRICKY, '{"who":{"name":"Café"}}', verbatim=False)
    assert not accepts(grammars, tokenizer, schema, TRICKY, '{"who":{"name":"Paris"}}', verbatim=False)


def test_refs_and_formats_keep_their_normal_grammar(grammars, tokenizer):
    schema = {"$defs": {"code": {"type": "string", "pattern": "^[A-Z]{3}$"}},
              "type": "object", "properties": {"c": {"$ref": "#/$defs/code"}, "d": {"type": "string", "format": "date"},
                                               "q": {"type": "string"}},
              "required": ["c", "d", "q"]}
    assert accepts(grammars, tokenizer, schema, TRICKY, '{"c":"XYZ","d":"2024-01-02","q":"End"}')
    assert not accepts(grammars, tokenizer, schema, TRICKY, '{"c":"xyz","d":"2024-01-02","q":"End"}')


@pytest.mark.parametrize("bad, where", [
    ({"type": "string", KEY: "yes"}, "/x-structspec-verbatim"),
    ({"type": "object", "properties": {"d": {"type": "string", "format": "date", KEY: True}}},
     "/properties/d/x-structspec-verbatim"),
    ({"type": "object", "properties": {"n": {"type": "number", KEY: True}}}, "/properties/n/x-structspec-verbatim"),
])
def test_misplaced_annotations_are_refused_naming_the_path(bad, where):
    with pytest.raises(SchemaError) as e:
        check_schema(bad)
    assert [p.path for p in e.value.problems] == [where]


def test_outlines_backend_refuses_verbatim_clearly(tokenizer):
    cache = GrammarCache(make_backend("outlines", tokenizer))
    with pytest.raises(SchemaError, match="needs the llguidance grammar backend"):
        cache.get_for(SCHEMA, TRICKY, True)


def run(engine, row, strategy, verbatim=True, max_tokens=48):
    return engine.extract(row["schema"], row["text"], RequestOptions(strategy=strategy, max_tokens=max_tokens,
                                                                     verbatim=verbatim))


@pytest.mark.parametrize("whitespace, at_least, max_tokens", [("compact", 20, 160), ("flexible", 3, 320)])
def test_every_string_is_a_document_span_on_50_documents(tiny_engine, tiny_compact_engine, whitespace, at_least,
                                                         max_tokens):
    """Random weights pick arbitrary tokens: only the grammar keeps strings inside the document.
    (In flexible mode they fill the whitespace gaps too, so fewer documents finish, with more
    tokens each.) The 50 run as one batch: the grammar, not the batch, is under test here, and
    one at a time is slower."""
    engine = tiny_compact_engine if whitespace == "compact" else tiny_engine
    assert engine.settings.json_whitespace == whitespace
    rows = deepjsoneval_rows(50)
    opts = RequestOptions(strategy="none", max_tokens=max_tokens, verbatim=True)
    checked = 0
    for row, res in zip(rows, engine.run([Request(row["schema"], row["text"], opts) for row in rows]), strict=True):
        assert res.stats.verbatim
        if res.status != "succeeded":
            continue
        for s in strings_of(res.value):
            if s in json.dumps(row["schema"]):  # keys and enum values are not verbatim
                continue
            assert s in row["text"], (row["id"], s)
            checked += 1
    assert checked >= at_least  # the assertion above ran on real values


def test_speculative_output_matches_none_in_verbatim_mode(tiny_engine):
    for row in deepjsoneval_rows(8):
        base = run(tiny_engine, row, "none")
        for strategy in STRATEGIES:
            assert run(tiny_engine, row, strategy).tokens == base.tokens, (row["id"], strategy)
