"""CLI input errors are clear, exit 2, and happen before any model loads."""

from __future__ import annotations

import json

import pytest

from structspec.cli import main


def run_cli(capsys, *argv):
    with pytest.raises(SystemExit) as e:
        main(list(argv))
    return e.value.code, capsys.readouterr().err


def test_missing_schema_file(capsys, tmp_path):
    code, err = run_cli(capsys, "extract", "--schema", str(tmp_path / "none.json"), "doc.txt")
    assert code == 2 and "cannot read schema" in err


def test_schema_file_that_is_not_json(capsys, tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    code, err = run_cli(capsys, "extract", "--schema", str(bad), "doc.txt")
    assert code == 2 and "is not valid JSON" in err and "line 1" in err


def test_unusable_schema_names_keyword_and_path(capsys, tmp_path):
    schema = tmp_path / "s.json"
    schema.write_text(json.dumps({"type": "array", "uniqueItems": True}))
    doc = tmp_path / "d.txt"
    doc.write_text("x")
    code, err = run_cli(capsys, "extract", "--schema", str(schema), str(doc))
    assert code == 2 and "/uniqueItems [uniqueItems]" in err


def test_missing_document(capsys, tmp_path):
    schema = tmp_path / "s.json"
    schema.write_text(json.dumps({"type": "object"}))
    code, err = run_cli(capsys, "extract", "--schema", str(schema), str(tmp_path / "missing.txt"))
    assert code == 2 and "cannot read document" in err


def test_bad_option_value(capsys, tmp_path):
    schema = tmp_path / "s.json"
    schema.write_text(json.dumps({"type": "object"}))
    doc = tmp_path / "d.txt"
    doc.write_text("x")
    code, err = run_cli(capsys, "extract", "--schema", str(schema), str(doc), "--draft-len", "999")
    assert code == 2 and "draft_len must be between 0 and 64" in err


@pytest.mark.model
def test_extract_prints_schema_valid_json_per_document(capsys):
    from pathlib import Path

    from structspec.grammar import validate_instance

    root = Path(__file__).resolve().parents[2]
    schema = json.loads((root / "schemas" / "event.json").read_text())
    code = main(["extract", "--schema", str(root / "schemas" / "event.json"),
                 str(root / "examples" / "event-jazz-night.txt"), "--stats", "--max-tokens", "200"])
    out, err = capsys.readouterr()
    assert code == 0, err
    value = json.loads(out.strip().splitlines()[0])
    assert validate_instance(schema, value) == []
    stats = json.loads(err.strip().splitlines()[-1])
    for key in ("strategy", "draft_len", "output_tokens", "target_passes", "proposed", "accepted",
                "acceptance_rate", "tokens_per_pass", "prefill_s", "decode_s", "wall_s"):
        assert key in stats
