"""Schema rewrites applied before compilation. Every rewrite narrows, never widens:
whatever the rewritten schema admits, the original admits too.
"""

from __future__ import annotations

import copy
from typing import Any

# Keywords that make an object's set of allowed keys depend on more than `properties`.
_OPEN_KEYS = ("additionalProperties", "patternProperties", "unevaluatedProperties",
              "propertyNames", "dependentSchemas", "if", "allOf", "$ref", "$dynamicRef")


def close_objects(schema: Any) -> Any:
    """Copy of `schema` where objects that list `properties` forbid undeclared keys.

    JSON Schema allows extra keys unless `additionalProperties` says otherwise. For
    extraction that default is harmful: a small model invents keys (observed: SmolLM2
    nesting an invented "morphology" key hundreds of times) and nothing after a value
    is forced. An explicit `additionalProperties` (or any keyword listed above) is left
    alone, and so are subschemas of `allOf`, where closing one branch would reject the
    keys of another.
    """
    out = copy.deepcopy(schema)
    _close(out, inside_all_of=False)
    return out


def _close(node: Any, inside_all_of: bool) -> None:
    if isinstance(node, list):
        for item in node:
            _close(item, inside_all_of)
        return
    if not isinstance(node, dict):
        return
    if ("properties" in node and isinstance(node["properties"], dict) and not inside_all_of
            and not any(k in node for k in _OPEN_KEYS)):
        node["additionalProperties"] = False
    for key, value in node.items():
        if key in ("enum", "const", "examples", "default"):
            continue  # instance data, not subschemas
        if key == "properties" and isinstance(value, dict):
            for sub in value.values():
                _close(sub, False)
        else:
            _close(value, inside_all_of or key == "allOf")
