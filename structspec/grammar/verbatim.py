"""Verbatim extraction: string values that can only be spans of the document.

Most extraction fields (names, dates, addresses, ids) are spans of the document. In
verbatim mode a plain string field is compiled to llguidance's substring lexeme over the
document, so the model cannot invent a value or loop inside one: the decoded value is
always an exact substring of the document (no normalisation), starting and ending on a
word boundary (a run of letters/digits, one whitespace character or one punctuation
character is the unit), and it may be empty.

Which strings are verbatim:
  * the request's default (`options.verbatim`, `--verbatim`), and
  * the annotation `"x-structspec-verbatim": true | false` on any subschema, which sets the
    default for that subschema and everything below it (on the root: the whole schema).
Only *plain* strings become verbatim: `{"type": "string"}` with annotations (title,
description, ...) but no enum, const, format, pattern or length bound; those keep their
normal grammar, as do keys, numbers, booleans and null. An explicit `true` on anything else
is refused at registration.

How: the schema becomes a Lark grammar. Objects (declared `properties`, closed) and arrays
(`items`, min/maxItems) on the way to a verbatim string are spelled out as rules; every
other subschema is embedded whole as `%json {...}` with the root's `$defs`, so it keeps
llguidance's full JSON Schema semantics. A verbatim string under a construct that is not
spelled out (anyOf, $ref, allOf, ...) stays free; the result is validated with jsonschema
either way.
"""

from __future__ import annotations

import json
import re
from typing import Any

from structspec.grammar.base import WHITESPACE_CAP, SchemaError, SchemaProblem
from structspec.grammar.validation import pointer

KEY = "x-structspec-verbatim"
# Keywords that say nothing about which strings are valid.
_ANNOTATIONS = {"title", "description", "$comment", "examples", "default", "deprecated", "readOnly",
                "writeOnly", "$id", "$anchor", "$schema", KEY}
_OBJECT_KEYS = _ANNOTATIONS | {"type", "properties", "required", "additionalProperties", "$defs", "definitions"}
_ARRAY_KEYS = _ANNOTATIONS | {"type", "items", "minItems", "maxItems", "$defs", "definitions"}
# A word, one whitespace character or one other character: the units a span starts and ends on.
_CHUNK = re.compile(r"\w+|\s|[^\w\s]")


def is_plain_string(node: Any) -> bool:
    return isinstance(node, dict) and node.get("type") == "string" and set(node) <= _ANNOTATIONS | {"type"}


def check_annotations(schema: Any) -> None:
    """SchemaError for a `x-structspec-verbatim` that is not a boolean, or `true` on a
    subschema that can hold no plain string."""
    problems = []

    def walk(node: Any, path: tuple) -> None:
        if isinstance(node, list):
            for i, item in enumerate(node):
                walk(item, path + (i,))
            return
        if not isinstance(node, dict):
            return
        if KEY in node:
            value = node[KEY]
            where = pointer(path + (KEY,))
            if not isinstance(value, bool):
                problems.append(SchemaProblem(where, f"{KEY} must be true or false", KEY))
            elif value and node.get("type") == "string" and not is_plain_string(node):
                extra = sorted(set(node) - _ANNOTATIONS - {"type"})
                problems.append(SchemaProblem(where, f"{KEY} applies to plain strings; this string also has "
                                                     f"{', '.join(extra)}, which keep their normal grammar", KEY))
            elif value and node.get("type") in ("number", "integer", "boolean", "null"):
                problems.append(SchemaProblem(where, f"{KEY} applies to strings, not {node['type']}", KEY))
        for k, v in node.items():
            if k not in ("enum", "const", "examples", "default"):
                walk(v, path + (k,))

    walk(schema, ())
    if problems:
        raise SchemaError(problems)


def uses_verbatim(node: Any, inherited: bool) -> bool:
    """Whether any string of `node` is verbatim when the request's (or enclosing
    subschema's) default is `inherited`."""
    if not isinstance(node, dict):
        return False
    on = node.get(KEY, inherited) is True
    if is_plain_string(node):
        return on
    if _spelled_object(node):
        return any(uses_verbatim(sub, on) for sub in node["properties"].values())
    if _spelled_array(node):
        return uses_verbatim(node["items"], on)
    return False


def _spelled_object(node: dict) -> bool:
    return (node.get("type") == "object" and isinstance(node.get("properties"), dict)
            and node.get("additionalProperties", False) is False and set(node) <= _OBJECT_KEYS)


def _spelled_array(node: dict) -> bool:
    return node.get("type") == "array" and isinstance(node.get("items"), dict) and set(node) <= _ARRAY_KEYS


def document_chunks(document: str) -> list[str]:
    """The document's units, each JSON-escaped as it appears inside a JSON string."""
    return [json.dumps(c, ensure_ascii=False)[1:-1] for c in _CHUNK.findall(document)]


def lark_literal(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


class _LarkWriter:
    def __init__(self, schema: dict, json_options: dict):
        self.rules: list[str] = []
        self.count = 0
        self.json_options = json_options
        # flexible whitespace (base.py): an optional gap around every structural token the
        # rules spell out, as the embedded %json parts allow through their options
        self.ws = "WS? " if json_options.get("whitespace_flexible") else ""
        self.defs = {k: schema[k] for k in ("$defs", "definitions") if k in schema}

    def new(self, prefix: str, body: str) -> str:
        self.count += 1
        name = f"{prefix}_{self.count}"
        self.rules.append(f"{name}: {body}")
        return name

    def embed(self, node: Any) -> str:
        """`node` compiled by llguidance's JSON Schema support, with the root's $defs."""
        sub = dict(node) if isinstance(node, dict) else node
        if isinstance(sub, dict):
            sub = {**{k: v for k, v in self.defs.items() if k not in sub}, **sub}
            sub["x-guidance"] = self.json_options
        elif sub is True:
            sub = {"x-guidance": self.json_options}
        return self.new("json", "%json " + json.dumps(sub, ensure_ascii=False))

    def value(self, node: Any, inherited: bool) -> str:
        if not isinstance(node, dict) or not uses_verbatim(node, inherited):
            return self.embed(node)
        on = node.get(KEY, inherited) is True
        if is_plain_string(node):
            return "VERBATIM_STRING"
        if _spelled_object(node):
            return self.object(node, on)
        return self.array(node, on)

    def object(self, node: dict, on: bool) -> str:
        props = list(node["properties"].items())
        required = set(node.get("required") or [])
        ws = self.ws
        members = [(lark_literal(json.dumps(k, ensure_ascii=False)) + f' {ws}":" {ws}' + self.value(v, on), k in required)
                   for k, v in props]
        # first_i: members i.. when none has been written yet; rest_i: after one has (comma first).
        first, rest = "", ""
        for member, req in reversed(members):
            new_rest = f'{ws}"," {ws}{member} {rest}'.strip()
            if not req:
                new_rest = self.new("opt", f"({new_rest}) | ({rest})" if rest else f"({new_rest})?")
            new_first = f"{member} {rest}".strip()
            if not req:
                new_first = self.new("opt", f"({new_first}) | ({first})" if first else f"({new_first})?")
            first, rest = new_first, new_rest
        return self.new("obj", f'"{{" {ws}{first} {ws}"}}"' if first else f'"{{" {ws}"}}"')

    def array(self, node: dict, on: bool) -> str:
        item = self.value(node["items"], on)
        ws = self.ws
        lo, hi = int(node.get("minItems", 0)), node.get("maxItems")
        if hi is not None and int(hi) == 0:
            return self.new("arr", f'"[" {ws}"]"')
        if hi is None and lo <= 1:
            seq = f'{item} ({ws}"," {ws}{item})*'
        else:
            more = f"{max(lo - 1, 0)},{int(hi) - 1 if hi is not None else ''}"
            seq = f'{item} ({ws}"," {ws}{item}){{{more}}}'
        return self.new("arr", f'"[" {ws}{seq} {ws}"]"' if lo >= 1 else f'"[" {ws}({seq} {ws})? "]"')


def build_lark(schema: dict, document: str, default: bool, json_options: dict) -> str:
    """A Lark grammar for `schema` (already normalised) whose verbatim strings are spans of
    `document`, allowing the whitespace the plain grammar allows (`json_options`)."""
    writer = _LarkWriter(schema, json_options)
    root = writer.value(schema, default)
    chunks = document_chunks(document) or [""]
    lines = [f"start: {root}",
             'VERBATIM_STRING: "\\"" DOCUMENT_SPAN "\\""',
             "DOCUMENT_SPAN: %regex " + json.dumps({"substring_chunks": chunks}, ensure_ascii=False)]
    if writer.ws:
        lines.append(f"WS: /[ \\t\\n\\r]{{1,{WHITESPACE_CAP}}}/")
    return "\n".join(lines + writer.rules) + "\n"
