"""Unusable schemas are refused with the keyword and JSON path; usable ones are narrowed safely."""

from __future__ import annotations

import pytest

from structspec.grammar import GrammarCache, SchemaError, check_schema, make_backend, schema_hash
from structspec.grammar.normalize import close_objects


def problems(schema):
    with pytest.raises(SchemaError) as e:
        check_schema(schema)
    return [p.as_dict() for p in e.value.problems]


def test_unsupported_keyword_is_named_with_its_path():
    got = problems({"type": "object", "properties": {"tags": {"type": "array", "uniqueItems": True}}})
    assert got == [{"path": "/properties/tags/uniqueItems", "keyword": "uniqueItems",
                    "message": "keyword 'uniqueItems' is not supported by the grammar engine"}]


def test_invalid_json_schema_is_named_with_its_path():
    got = problems({"type": "object", "properties": {"n": {"type": "integr"}}})
    assert got[0]["path"] == "/properties/n/type"
    assert "integr" in got[0]["message"]


def test_non_object_schema_and_unknown_draft_are_refused():
    assert problems([1])[0]["message"] == "a schema must be a JSON object"
    assert problems({"$schema": "http://example.com/mine"})[0]["path"] == "/$schema"


def test_draft_07_schema_is_checked_against_its_own_meta_schema():
    check_schema({"$schema": "http://json-schema.org/draft-07/schema#", "type": "object",
                  "properties": {"a": {"type": "string"}}})
    assert problems({"$schema": "http://json-schema.org/draft-07/schema#", "minLength": -1})[0]["path"] == "/minLength"


def test_close_objects_forbids_undeclared_keys_only_where_silent():
    schema = {"type": "object", "properties": {
        "a": {"type": "object", "properties": {"x": {"type": "string"}}},
        "b": {"type": "object", "properties": {"y": {}}, "additionalProperties": True},
        "c": {"allOf": [{"properties": {"p": {}}}, {"properties": {"q": {}}}]},
        "e": {"enum": [{"properties": {}}]}}}
    closed = close_objects(schema)
    assert closed["additionalProperties"] is False
    assert closed["properties"]["a"]["additionalProperties"] is False
    assert closed["properties"]["b"]["additionalProperties"] is True
    assert "additionalProperties" not in closed["properties"]["c"]["allOf"][0]
    assert closed["properties"]["e"] == {"enum": [{"properties": {}}]}
    assert "additionalProperties" not in schema  # the input is not modified


def test_schema_hash_ignores_key_order():
    assert schema_hash({"a": 1, "b": [1, 2]}) == schema_hash({"b": [1, 2], "a": 1})
    assert schema_hash({"a": 1}) != schema_hash({"a": 2})


def test_grammar_cache_compiles_once_per_schema(tokenizer):
    cache = GrammarCache(make_backend("llguidance", tokenizer))
    schema = {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]}
    assert cache.get(schema) is cache.get(dict(reversed(list(schema.items()))))
    with pytest.raises(SchemaError):
        cache.get({"type": "array", "uniqueItems": True})


def test_unknown_backend_is_rejected(tokenizer):
    with pytest.raises(ValueError, match="unknown grammar backend 'xgrammar'"):
        make_backend("xgrammar", tokenizer)
