"""Which values of an extraction are right: a result against the expected value (the truth), one
check per value, keyed by JSON Pointer like the spans and confidences ("/items/0/name").

Rules: strings match with whitespace runs collapsed and case ignored; numbers match by value
(10 == 10.0; a number never matches a string, so "10.00" is not 10); dates are strings and match
as written. Every value of the truth is one check, so the truth fixes the denominator: a value
the result lacks is wrong, a list item it lacks makes each of that item's values wrong. A value
the result has beyond the truth (a key, a list item) is one more check, wrong. A property the
schema leaves optional that neither has is one check, right.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from structspec.engine.grounding import leaves, pointer


class _Absent:
    """No value at this pointer (the truth or the result has none)."""

    def __repr__(self) -> str:
        return "absent"


ABSENT: Any = _Absent()


@dataclass(frozen=True)
class Check:
    pointer: str
    expected: Any  # ABSENT: the result's value is extra
    actual: Any  # ABSENT: the result misses the value
    right: bool


def score(expected: Any, actual: Any, schema: dict | None = None) -> list[Check]:
    """One check per value of `expected`, plus one (wrong) per value `actual` has beyond it, plus
    one (right) per property `schema` leaves optional and neither has; in the truth's order."""
    return _score(expected, actual, schema if isinstance(schema, dict) else {}, [])


def _score(expected: Any, actual: Any, schema: dict, path: list[str | int]) -> list[Check]:
    if isinstance(expected, dict) and isinstance(actual, dict):
        properties, required = schema.get("properties") or {}, set(schema.get("required") or ())
        checks = []
        for key in dict.fromkeys([*expected, *actual, *properties]):
            if key in expected or key in actual:
                checks += _score(expected.get(key, ABSENT), actual.get(key, ABSENT),
                                 _subschema(properties.get(key)), [*path, key])
            elif key not in required:
                checks.append(Check(pointer([*path, key]), ABSENT, ABSENT, True))
        return checks
    if isinstance(expected, list) and isinstance(actual, list):
        items = _subschema(schema.get("items"))
        return [check for i in range(max(len(expected), len(actual)))
                for check in _score(expected[i] if i < len(expected) else ABSENT,
                                    actual[i] if i < len(actual) else ABSENT, items, [*path, i])]
    if expected is ABSENT:
        return [Check(pointer(path), ABSENT, actual, False)]
    if isinstance(expected, (dict, list)) or isinstance(actual, (dict, list)):
        # missing, or an object where the truth has a list, a list where it has a string, ...:
        # each value of the truth is missing here and what the result has instead is extra
        missing = [Check(ptr, value, ABSENT, False) for ptr, value in leaves(expected, list(path))]
        return missing if actual is ABSENT else [*missing, Check(pointer(path), ABSENT, actual, False)]
    return [Check(pointer(path), expected, actual, actual is not ABSENT and same_value(expected, actual))]


def same_value(expected: Any, actual: Any) -> bool:
    """Two leaf values (string, number, boolean, null) match under the rules above."""
    if isinstance(expected, str) and isinstance(actual, str):
        return _normal(expected) == _normal(actual)
    if isinstance(expected, bool) or isinstance(actual, bool):
        return expected is actual
    if isinstance(expected, (int, float)) and isinstance(actual, (int, float)):
        return expected == actual
    return expected is None and actual is None


def _normal(text: str) -> str:
    return " ".join(text.split()).casefold()


def _subschema(schema: Any) -> dict:
    return schema if isinstance(schema, dict) else {}
