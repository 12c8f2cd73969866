"""The demo's truth: examples/*.expected.json, one per document it extracts, each valid under the
schema that document is extracted with; and the demo's tables mark each value against it."""

from __future__ import annotations

import json

import jsonschema
import pytest

from structspec.demo import Scores, demo_examples, expected_path, grounding_table, model_hint
from structspec.layout import data_dir
from structspec.scoring import ABSENT

EXPECTED = sorted((data_dir("examples")).glob("*.expected.json"))


def test_every_document_the_demo_extracts_has_its_expected_values():
    assert [p.name for p in demo_examples() if not expected_path(p).is_file()] == []
    assert sorted(expected_path(p) for p in demo_examples()) == EXPECTED


@pytest.mark.parametrize("path", EXPECTED, ids=lambda p: p.name)
def test_expected_values_validate_against_the_schema_their_document_uses(path):
    document = next(p for p in demo_examples() if expected_path(p) == path)
    schema = json.loads((data_dir("schemas") / demo_examples()[document]).read_text(encoding="utf-8"))
    jsonschema.Draft202012Validator(schema).validate(json.loads(path.read_text(encoding="utf-8")))


def test_the_batch_table_marks_each_value_and_scores_the_document():
    scores = Scores()
    result = {"name": "Chloe Martin", "job_title": "Studio Manager", "company": "Atelier Lumiere, Lyon",
              "email": "chloe.martin@atelier-lumiere.fr", "phone": "+33 4 55 55 01 42", "city": "lyon"}
    schema = json.loads((data_dir("schemas") / "contact.json").read_text(encoding="utf-8"))
    checks = scores.check(data_dir("examples") / "contact-atelier.txt", schema, result)
    line = {"id": "contact-atelier.txt", "status": "succeeded", "result": result, "spans": {}, "confidence": {}}

    table = grounding_table(line, checks)

    assert table[1].startswith("  /name") and table[1].endswith("✓")
    assert table[3].startswith("  /company") and table[3].endswith('✗ expected "Atelier Lumiere"')
    assert table[6].endswith("✓")  # the city, case aside
    assert table[-1] == "contact-atelier.txt: 5/6 values right"
    assert scores.total() == (5, 6)


def test_a_failed_document_scores_zero_and_the_end_names_a_bigger_model():
    scores = Scores()
    schema = json.loads((data_dir("schemas") / "contact.json").read_text(encoding="utf-8"))
    checks = scores.check(data_dir("examples") / "contact-tideway.txt", schema, ABSENT)
    line = {"id": "contact-tideway.txt", "status": "failed", "error": "max_tokens"}

    assert grounding_table(line, checks)[-1] == "contact-tideway.txt: 0/6 values right"
    hint = model_hint("default", *scores.total())
    assert hint[0] == "overall: 0/6 values right (against examples/*.expected.json)"
    assert "--model" in hint[1] and "STRUCTSPEC_MODEL" in hint[1]
    assert model_hint("/models/big.gguf", 6, 6) == ["overall: 6/6 values right (against examples/*.expected.json)"]
