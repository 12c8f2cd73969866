"""The schema as the extraction prompt shows it (engine/prompt.py field_list)."""

from __future__ import annotations

import json
from pathlib import Path

from structspec.engine.prompt import extraction_messages, field_list

ROOT = Path(__file__).resolve().parents[3]


def test_the_receipt_schema_as_a_field_list():
    schema = json.loads((ROOT / "schemas" / "receipt.json").read_text())
    assert field_list(schema) == "\n".join([
        "- merchant (string): Shop name as printed at the top",
        "- date (string): Date of purchase as printed",
        "- items (list of object)",
        "  each item:",
        "    - name (string)",
        "    - price (number)",
        "- total (number): Amount paid, including tax",
        '- payment (one of "cash", "card", "other")',
    ])


def test_refs_unions_formats_and_recursion_are_rendered_without_looping():
    schema = {"$defs": {"node": {"type": "object", "properties": {"child": {"$ref": "#/$defs/node"}}}},
              "type": "object", "title": "T",
              "properties": {"when": {"type": "string", "format": "date", "title": "when"},
                             "n": {"anyOf": [{"type": "integer"}, {"type": "null"}]},
                             "tags": {"type": ["array", "null"]},
                             "tree": {"$ref": "#/$defs/node"}}}
    text = field_list(schema)
    assert text.splitlines()[:4] == ["- when (string, date)", "- n (integer or null)", "- tags (array or null)",
                                     "- tree (object)"]
    assert text.count("child (object)") == 7  # recursion stops at FIELD_LIST_DEPTH


def test_a_schema_that_is_not_an_object_is_named_by_its_kind_and_the_document_comes_last():
    assert field_list({"type": "array", "items": {"type": "string"}}) == "- a JSON value (list of string)"
    messages = extraction_messages({"type": "object", "properties": {"a": {"type": "string"}}}, "DOC")
    assert messages[1]["content"] == "Fields to extract:\n- a (string)\n\nDocument:\nDOC"
