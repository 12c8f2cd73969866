"""Meta-schema checks, result validation and locating keywords in a schema, shared by every
backend.

Result validation is jsonschema's, with one change: its keyword code (`pattern`,
`patternProperties`, and `additionalProperties` / `unevaluatedProperties` beside
`patternProperties`) calls `re.search` from its own modules' namespace, and those three modules
get `_LINEAR_RE` instead, whose `search` runs on RE2 (grammar/regex.py); the `regex` format is
checked by RE2 too. No user pattern reaches Python's backtracking `re` in this process.
"""

from __future__ import annotations

import re
from typing import Any, Iterator

import jsonschema
import jsonschema._keywords
import jsonschema._legacy_keywords
import jsonschema._utils
from jsonschema.validators import validator_for

from structspec.grammar import regex
from structspec.grammar.base import SchemaError, SchemaProblem


class _LinearRe:
    """Stands in for the `re` module inside jsonschema's keyword code, which only calls
    `re.search(pattern, string)` with schema patterns."""

    search = staticmethod(regex.search)

    def __getattr__(self, name: str):
        return getattr(re, name)


_LINEAR_RE = _LinearRe()
for _module in (jsonschema._keywords, jsonschema._legacy_keywords, jsonschema._utils):
    if getattr(_module, "re", None) is not re:  # a jsonschema other than the pinned one: look again
        raise ImportError(f"{_module.__name__} no longer takes `re` from its namespace; "
                          "structspec's linear-time patterns need a look at this jsonschema version")
    _module.re = _LINEAR_RE

DEFAULT_DRAFT = jsonschema.Draft202012Validator
SUPPORTED_DRAFTS = {
    "https://json-schema.org/draft/2020-12/schema": jsonschema.Draft202012Validator,
    "https://json-schema.org/draft/2019-09/schema": jsonschema.Draft201909Validator,
    "http://json-schema.org/draft-07/schema": jsonschema.Draft7Validator,
    "http://json-schema.org/draft-06/schema": jsonschema.Draft6Validator,
    "http://json-schema.org/draft-04/schema": jsonschema.Draft4Validator,
}


def validator_class(schema: Any) -> type:
    """The jsonschema validator for the schema's `$schema` (Draft 2020-12 when absent)."""
    if isinstance(schema, dict) and "$schema" in schema:
        uri = str(schema["$schema"]).rstrip("#")
        if uri not in SUPPORTED_DRAFTS:
            raise SchemaError([SchemaProblem("/$schema", f"unsupported $schema {uri!r}; "
                                             f"use one of {sorted(SUPPORTED_DRAFTS)}", "$schema")])
        return SUPPORTED_DRAFTS[uri]
    return validator_for(schema, default=DEFAULT_DRAFT) if isinstance(schema, dict) else DEFAULT_DRAFT


def pointer(parts) -> str:
    return "".join("/" + str(p).replace("~", "~0").replace("/", "~1") for p in parts)


def check_meta_schema(schema: Any) -> None:
    """Raise SchemaError listing every way `schema` violates its meta-schema, or every pattern
    of it that cannot run on the linear-time engine."""
    if not isinstance(schema, dict):
        raise SchemaError([SchemaProblem("", "a schema must be a JSON object", "type")])
    cls = validator_class(schema)
    errors = sorted(cls(cls.META_SCHEMA).iter_errors(schema), key=lambda e: list(e.absolute_path))
    if errors:
        raise SchemaError([SchemaProblem(pointer(e.absolute_path), e.message, e.validator)
                           for e in errors])
    check_patterns(schema)


def check_patterns(schema: Any) -> None:
    """Raise SchemaError naming each `pattern` / `patternProperties` key that RE2 cannot run."""
    problems = []
    for path, pattern in regex.schema_patterns(schema):
        try:
            regex.compiled(pattern)
        except regex.PatternError as e:
            problems.append(SchemaProblem(pointer(path), f"pattern {pattern!r}: {e}", path[-1] if path[-1] == "pattern"
                                          else "patternProperties"))
    if problems:
        raise SchemaError(problems)


def find_keyword(schema: Any, keyword: str, _path: tuple = ()) -> Iterator[str]:
    """JSON pointers of every object in `schema` that has `keyword` as a key."""
    if isinstance(schema, dict):
        for k, v in schema.items():
            if k == keyword:
                yield pointer(_path + (k,))
            yield from find_keyword(v, keyword, _path + (k,))
    elif isinstance(schema, list):
        for i, v in enumerate(schema):
            yield from find_keyword(v, keyword, _path + (i,))


_FORMAT_CHECKERS: dict[type, jsonschema.FormatChecker] = {}


def format_checker(cls: type) -> jsonschema.FormatChecker:
    """`cls`'s format checker with `regex` checked by RE2."""
    if cls not in _FORMAT_CHECKERS:
        checker = jsonschema.FormatChecker(())
        checker.checkers = {**cls.FORMAT_CHECKER.checkers, "regex": (regex.is_regex, regex.PatternError)}
        _FORMAT_CHECKERS[cls] = checker
    return _FORMAT_CHECKERS[cls]


def validate_instance(schema: dict, instance: Any) -> list[SchemaProblem]:
    """Every way `instance` violates `schema` (empty when it is valid). A schema that cannot be
    checked (a pattern RE2 cannot run, a `$ref` loop with no end: both refused at registration
    since they were found) is one problem saying so, never an exception."""
    cls = validator_class(schema)
    v = cls(schema, format_checker=format_checker(cls))
    try:
        errors = sorted(v.iter_errors(instance), key=lambda e: list(e.absolute_path))
    except regex.PatternError as e:
        return [SchemaProblem("", f"the schema has a pattern that cannot be checked: {e}", "pattern")]
    except RecursionError:
        return [SchemaProblem("", "the schema's $ref recursion does not end; it cannot be checked", "$ref")]
    return [SchemaProblem(pointer(e.absolute_path), e.message, e.validator) for e in errors]
