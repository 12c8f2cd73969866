"""What Litestar's OpenAPI generation leaves out of the request schemas, added back so the
document says what the API accepts.

- A struct declared `forbid_unknown_fields=True` rejects unknown keys (422): its schema gets
  `additionalProperties: false` (Litestar documents every object as open).
- A struct may carry `__openapi_extra__`, a dict of JSON Schema keywords merged into its
  component schema (e.g. `oneOf` for "exactly one of these fields").
"""

from __future__ import annotations

from typing import Any

from litestar._openapi.schema_generation.plugins.struct import StructSchemaPlugin
from litestar.openapi.spec import Schema

# JSON Schema keyword -> litestar Schema attribute, for the keywords used in __openapi_extra__.
_ATTRIBUTES = {"oneOf": "one_of", "anyOf": "any_of", "allOf": "all_of", "not": "not_"}


class StrictStructSchemaPlugin(StructSchemaPlugin):
    """Litestar's msgspec.Struct schema, plus `additionalProperties: false` and `__openapi_extra__`."""

    def to_openapi_schema(self, field_definition, schema_creator) -> Schema:
        schema = super().to_openapi_schema(field_definition, schema_creator)
        struct = field_definition.type_
        if getattr(struct.__struct_config__, "forbid_unknown_fields", False):
            schema.additional_properties = False
        extra: dict[str, Any] = getattr(struct, "__openapi_extra__", None) or {}
        for keyword, value in extra.items():
            setattr(schema, _ATTRIBUTES[keyword], value)
        return schema
