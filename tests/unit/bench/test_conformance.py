"""The conformance runner on a small copied sample (tests/fixtures/conformance, see NOTICE.md),
so `python -m bench.conformance` keeps working, plus the guarantees the full report relies on."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.conformance import main
from structspec.grammar import SchemaError, check_schema

SAMPLE = Path(__file__).resolve().parents[2] / "fixtures" / "conformance"


def test_runner_reports_every_keyword_file_and_split_with_no_silent_false_accept(tmp_path, capsys):
    assert main(["--data", str(SAMPLE), "--backends", "llguidance", "--mask-samples", "4", "--examples", "50",
                 "--json", str(tmp_path / "report.json")]) == 0
    out = capsys.readouterr().out
    for row in ("| minimum |", "| enum |", "| oneOf |", "| format |", "| uniqueItems |", "| Github_easy |", "| JME |"):
        assert row in out
    report = json.loads((tmp_path / "report.json").read_text())
    suite = report["test_suite"]["llguidance"]
    assert suite["minimum"]["correct"] == suite["minimum"]["tests"] > 0  # numeric bounds are enforced
    assert suite["uniqueItems"]["refused"] == suite["uniqueItems"]["schemas"]  # refused, never half-enforced
    tallies = list(suite.values()) + list(report["jsonschemabench"]["llguidance"].values())
    assert sum(t["tests"] for t in tallies) > 100
    assert sum(t["false_accept_silent"] for t in tallies) == 0


def test_unknown_formats_and_overlapping_one_of_compile_with_warnings_naming_them():
    warnings = check_schema({"type": "object", "properties": {
        "site": {"type": "string", "format": "url"},
        "v": {"oneOf": [{"type": "string"}, {"type": "string", "maxLength": 3}]}}})
    assert [(w.path, w.keyword) for w in warnings] == [("/properties/site/format", "format"),
                                                        ("/properties/v/oneOf", "oneOf")]
    assert check_schema({"type": "string", "format": "date"}) == []  # a format the grammar enforces


@pytest.mark.parametrize("draft", ["http://json-schema.org/draft-04/schema#", "http://json-schema.org/draft-06/schema#"])
def test_older_drafts_are_checked_against_their_own_meta_schema(draft):
    assert check_schema({"$schema": draft, "type": "object", "properties": {"a": {"type": "integer"}}}) == []
    with pytest.raises(SchemaError, match="type"):
        check_schema({"$schema": draft, "type": "objekt"})


def test_a_grammar_past_the_engine_limits_is_refused_not_left_to_a_worker():
    """llguidance's own construction limits (lexer size, fuel) turn a runaway schema into a
    SchemaError at registration: here a 100,000-value enum (~1.3 s to hit the limit)."""
    with pytest.raises(SchemaError, match="too big"):
        check_schema({"enum": [f"value-{i}" for i in range(100_000)]})
