"""Meta-schema checks and locating keywords in a schema, shared by every backend."""

from __future__ import annotations

from typing import Any, Iterator

import jsonschema
from jsonschema.validators import validator_for

from structspec.grammar.base import SchemaError, SchemaProblem

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
    """Raise SchemaError listing every way `schema` violates its meta-schema."""
    if not isinstance(schema, dict):
        raise SchemaError([SchemaProblem("", "a schema must be a JSON object", "type")])
    cls = validator_class(schema)
    errors = sorted(cls(cls.META_SCHEMA).iter_errors(schema), key=lambda e: list(e.absolute_path))
    if errors:
        raise SchemaError([SchemaProblem(pointer(e.absolute_path), e.message, e.validator)
                           for e in errors])


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


def validate_instance(schema: dict, instance: Any) -> list[SchemaProblem]:
    """Every way `instance` violates `schema` (empty when it is valid)."""
    cls = validator_class(schema)
    v = cls(schema, format_checker=cls.FORMAT_CHECKER)
    return [SchemaProblem(pointer(e.absolute_path), e.message, e.validator)
            for e in sorted(v.iter_errors(instance), key=lambda e: list(e.absolute_path))]
