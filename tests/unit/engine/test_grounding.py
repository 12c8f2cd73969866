"""Spans and confidences of a result (structspec/engine/grounding.py), on hand-made cases."""

from __future__ import annotations

import json

import pytest

from structspec.engine.grounding import confidences, find_spans, leaf_positions, pointer, string_leaves


def test_pointers_escape_slash_and_tilde():
    assert pointer(["a/b", "c~d", 0]) == "/a~1b/c~0d/0"


def test_each_string_gets_the_occurrence_after_the_previous_span():
    doc = "Total 5.00. Shop: Cafe. Item Tea 5.00 Total 5.00"
    value = {"shop": "Cafe", "items": [{"name": "Tea", "price": "5.00"}], "total": "5.00", "again": "Shop"}
    spans = find_spans(doc, value)
    assert spans == {"/shop": [18, 22], "/items/0/name": [29, 32], "/items/0/price": [33, 37],
                     "/total": [44, 48], "/again": [12, 16]}  # nothing after 48: the nearest before
    for ptr, (start, end) in spans.items():
        assert doc[start:end] in json.dumps(value)


def test_values_that_do_not_occur_and_empty_strings_are_not_grounded():
    assert find_spans("abc", {"x": "zzz", "e": "", "n": 3, "list": ["b"]}) == {"/x": None, "/e": None,
                                                                               "/list/0": [1, 2]}


def test_escaped_values_are_matched_unescaped():
    doc = 'He said "hi"\tthen left. Café'
    value = json.loads('{"q": "\\"hi\\"\\t", "w": "Caf\\u00e9"}')
    spans = find_spans(doc, value)
    assert doc[slice(*spans["/q"])] == value["q"] and doc[slice(*spans["/w"])] == "Café"


def test_leaf_positions_cover_every_leaf_with_its_text():
    text = '{"a": "h\\u00e9\\"llo", "b": [1, true, null, ""], "c": {"d": -2.5e3, "e": {}}, "f": []}'
    leaves = leaf_positions(text)
    assert [(p, text[s:e]) for p, s, e in leaves] == [
        ("/a", '"h\\u00e9\\"llo"'), ("/b/0", "1"), ("/b/1", "true"), ("/b/2", "null"), ("/b/3", '""'),
        ("/c/d", "-2.5e3")]


def test_confidence_takes_the_tokens_overlapping_each_leaf():
    tokens = [b'{"', b'name', b'":"', b'Ad', b'a', b'","', b'n', b'":', b'3', b'6', b'}']
    probs = [1.0, 1.0, 1.0, 0.5, 0.9, 1.0, 1.0, 1.0, 0.8, 0.6, 1.0]
    text = b"".join(tokens).decode()
    conf = confidences(text, tokens, probs)
    assert conf["/name"] == {"min": 0.5, "mean": 0.7}
    assert conf["/n"] == {"min": 0.6, "mean": 0.7}


def test_confidence_handles_a_character_split_across_tokens():
    e_acute = "é".encode()
    tokens = [b'["', b"caf" + e_acute[:1], e_acute[1:] + b'"', b"]"]
    text = b"".join(tokens).decode()
    conf = confidences(text, tokens, [1.0, 0.5, 0.25, 1.0])
    assert conf == {"/0": {"min": 0.25, "mean": 0.375}}


@pytest.mark.parametrize("text", ['"just a string"', "12", "[]", "{}"])
def test_top_level_scalars_and_empty_containers(text):
    leaves = leaf_positions(text)
    assert leaves == ([("", 0, len(text))] if text[0] not in "[{" else [])


# --- on engine results ------------------------------------------------------------------------

def check_grounding(document: str, result) -> tuple[int, int]:
    """Every string of a succeeded result has a span exactly where the document holds it, or
    null where the document does not hold it; every leaf has a confidence in [0, 1]. Returns
    (strings, grounded)."""
    assert result.status == "succeeded"
    leaves = dict(string_leaves(result.value))
    assert set(result.spans) == set(leaves), (result.spans, leaves)
    for ptr, value in leaves.items():
        span = result.spans[ptr]
        if span is None:
            assert value == "" or value not in document, (ptr, value)
        else:
            assert document[span[0]:span[1]] == value, (ptr, value, span)
    positions = [p for p, _, _ in leaf_positions(result.text)]
    assert set(result.confidence) <= set(positions) and len(result.confidence) >= len(positions) - 1
    for c in result.confidence.values():
        assert 0.0 <= c["min"] <= c["mean"] <= 1.0
    return len(leaves), sum(s is not None for s in result.spans.values())


def same_grounding(a, b, tolerance: float = 1e-4) -> None:
    """Two runs with the same output: the same spans, confidences equal within float noise."""
    assert a.tokens == b.tokens
    assert a.spans == b.spans
    assert a.confidence.keys() == b.confidence.keys()
    for ptr, c in a.confidence.items():
        assert abs(c["min"] - b.confidence[ptr]["min"]) <= tolerance, (ptr, c, b.confidence[ptr])
        assert abs(c["mean"] - b.confidence[ptr]["mean"]) <= tolerance, (ptr, c, b.confidence[ptr])


# free strings are bounded (a random model loops in them); every enum option is in the text
FREE = {"type": "object", "required": ["merchant", "where", "paid", "notes"], "properties": {
    "merchant": {"type": "string", "maxLength": 12},
    "where": {"enum": ["Jalan Ampang", "SUNRISE MART"]},
    "paid": {"enum": ["card", "cash"]},
    "notes": {"type": "array", "maxItems": 2, "items": {"type": "string", "maxLength": 6}}}}


def test_free_mode_values_are_grounded_where_they_occur_whatever_the_strategy(tiny_engine):
    from structspec.options import STRATEGIES, RequestOptions
    from tests.unit.engine.test_exactness import RECEIPT_TEXT

    text = RECEIPT_TEXT + "\nPaid by cash? No."
    runs = {s: tiny_engine.extract(FREE, text, RequestOptions(strategy=s, draft_len=4, max_tokens=96))
            for s in STRATEGIES}
    strings, grounded = check_grounding(text, runs["none"])
    print(f"\nfree mode: {grounded} of {strings} strings grounded: {runs['none'].value}")
    assert grounded >= 2  # the enums
    for strategy, result in runs.items():
        check_grounding(text, result)
        same_grounding(runs["none"], result)


def test_an_occurrence_inside_a_longer_word_is_the_last_resort():
    assert find_spans("label: b, ok", {"label": "b"}) == {"/label": [7, 8]}
    assert find_spans("lab", {"x": "b"}) == {"/x": [2, 3]}  # no other
    assert find_spans("b then label", {"a": "then", "b": "b"}) == {"/a": [2, 6], "/b": [0, 1]}  # before, whole
