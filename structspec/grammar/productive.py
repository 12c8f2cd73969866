"""Whether a schema can produce any output at all: refused at registration when it cannot.

A schema may allow no finite JSON value (`{"$ref": "#"}`, two `$ref`s that only lead to each
other, a required property whose schema is such a loop), or only values longer than any output
(`"minItems": 10**18`). The grammar engine compiles both, and then allows no token, or a job runs
until `max_tokens` and fails; jsonschema recurses without end on the first. `shortest` computes a
lower bound on the length, in characters of compact JSON, of the shortest value a subschema
allows (`INFINITE`: none), as a least fixed point over the document's `$ref` targets: every
`$ref` starts at `INFINITE` and the bounds are recomputed until none shrinks.

Keywords that only ever narrow the values (`not`, `if`, formats, number bounds, `uniqueItems`)
are left out: that keeps the figure a lower bound, so a schema is refused only when no output is
possible, never because the analysis could not tell.
"""

from __future__ import annotations

import json
from typing import Any, Iterator

from structspec.grammar.base import SchemaError, SchemaProblem

INFINITE = float("inf")
_TYPES = ("null", "boolean", "integer", "number", "string", "array", "object")
_SCALAR = {"null": 4, "boolean": 4, "integer": 1, "number": 1}
_MIN_KEYWORDS = ("minItems", "minLength", "minProperties", "minContains")


def check_productive(schema: Any, max_chars: int, max_tokens: int) -> None:
    """Raise SchemaError when no value of `schema` exists, or none fits in `max_chars`
    characters (the most an output of `max_tokens` tokens can hold)."""
    bounds = _Bounds(schema)
    size = bounds.of(schema)
    if size == INFINITE:
        raise SchemaError(bounds.why_none())
    if size > max_chars:
        culprits = [p for p in _big_minimums(schema, max_chars // 4)] or [SchemaProblem("", "", None)]
        raise SchemaError([SchemaProblem(
            p.path, f"the shortest value this schema allows is at least {size:.3g} characters; no output of at "
                    f"most {max_tokens} tokens (max_tokens' largest value) can hold it"
                    + (f" ({p.message})" if p.message else ""), p.keyword) for p in culprits])


class _Bounds:
    def __init__(self, root: Any):
        self.root = root
        self.refs: dict[str, float] = {}  # $ref target -> current bound
        self._solve()

    def _solve(self) -> None:
        targets = sorted({ref for _, ref in _refs(self.root, "") if ref.startswith("#")})
        self.refs = {t: INFINITE for t in targets}
        for _ in range(len(targets) + 2):
            changed = False
            for target in targets:
                node = _resolve(self.root, target)
                size = 1 if node is _MISSING else self.of(node)  # an anchor or a missing target: unknown
                if size < self.refs[target]:
                    self.refs[target], changed = size, True
            if not changed:
                return

    def of(self, node: Any) -> float:
        """Lower bound on the compact-JSON length of the shortest value `node` allows."""
        if node is True or node == {}:
            return 1
        if node is False or not isinstance(node, dict):
            return INFINITE if node is False else 1
        parts = [self._own(node)]
        if isinstance(node.get("$ref"), str):
            parts.append(self.refs.get(node["$ref"], 1))  # a remote or unresolved $ref: unknown, assume small
        for key in ("allOf",):
            for sub in node.get(key) or []:
                parts.append(self.of(sub))
        for key in ("anyOf", "oneOf"):
            branches = node.get(key)
            if isinstance(branches, list):
                parts.append(min((self.of(b) for b in branches), default=INFINITE))
        return max(parts)

    def _own(self, node: dict) -> float:
        if "const" in node:
            return len(json.dumps(node["const"], separators=(",", ":"), ensure_ascii=False))
        if "enum" in node:
            values = node["enum"] if isinstance(node["enum"], list) else []
            return min((len(json.dumps(v, separators=(",", ":"), ensure_ascii=False)) for v in values),
                       default=INFINITE)
        kind = node.get("type", list(_TYPES))
        kinds = [kind] if isinstance(kind, str) else [k for k in kind if isinstance(k, str)]
        return min((self._of_type(node, k) for k in kinds), default=INFINITE)

    def _of_type(self, node: dict, kind: str) -> float:
        if kind in _SCALAR:
            return _SCALAR[kind]
        if kind == "string":
            return 2 + _count(node.get("minLength"))
        if kind == "array":
            return self._array(node)
        if kind == "object":
            return self._object(node)
        return INFINITE

    def _array(self, node: dict) -> float:
        n = max(_count(node.get("minItems")), _count(node.get("minContains", 1)) if "contains" in node else 0)
        if n == 0:
            return 2
        prefix = node.get("prefixItems") if isinstance(node.get("prefixItems"), list) else []
        rest = node.get("items", True)
        total = 2 + (n - 1)  # brackets and commas
        for i in range(min(n, len(prefix))):
            total += self.of(prefix[i])
        if n > len(prefix):
            total += (n - len(prefix)) * self.of(rest)  # inf * 0 never happens: n > len(prefix)
        return total

    def _object(self, node: dict) -> float:
        required = [r for r in node.get("required", []) if isinstance(r, str)] \
            if isinstance(node.get("required"), list) else []
        properties = node.get("properties") if isinstance(node.get("properties"), dict) else {}
        extra = node.get("additionalProperties", True)
        total = 2.0
        for name in dict.fromkeys(required):
            sub = properties[name] if name in properties else (True if node.get("patternProperties") else extra)
            total += len(json.dumps(name, ensure_ascii=False)) + 1 + self.of(sub)
        count = max(len(set(required)), _count(node.get("minProperties")))
        total += max(0, count - 1)  # commas
        total += max(0, count - len(set(required))) * 4  # more properties: at least "":0 each
        return total

    def why_none(self) -> list[SchemaProblem]:
        """Where the schema allows no value: each `$ref` whose target allows none (a loop with no
        way out), or the root."""
        dead = [(path, ref) for path, ref in _refs(self.root, "") if self.refs.get(ref, 1) == INFINITE]
        if dead:
            return [SchemaProblem(path, f"$ref {ref!r} allows no finite value: every way through it leads back to "
                                        "itself, so no output can ever satisfy it", "$ref") for path, ref in dead]
        return [SchemaProblem("", "no JSON value satisfies this schema, so no output can", None)]


_MISSING = object()


def _count(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0


def _refs(node: Any, path: str) -> Iterator[tuple[str, str]]:
    """(path of the $ref keyword, target) of every $ref in `node`."""
    if isinstance(node, dict):
        for key, value in node.items():
            if key in ("const", "enum", "default", "examples"):
                continue
            here = f"{path}/{str(key).replace('~', '~0').replace('/', '~1')}"
            if key == "$ref" and isinstance(value, str):
                yield here, value
            else:
                yield from _refs(value, here)
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from _refs(value, f"{path}/{i}")


def _resolve(root: Any, ref: str) -> Any:
    """The node a local `#/...` reference points at, or _MISSING."""
    node = root
    for part in ref[1:].split("/")[1:] if ref != "#" else []:
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return _MISSING
    return node


def _big_minimums(schema: Any, threshold: int, path: str = "") -> Iterator[SchemaProblem]:
    """Every min* keyword over `threshold`: the likely reason a schema's values are too long."""
    if isinstance(schema, dict):
        for key, value in schema.items():
            here = f"{path}/{str(key).replace('~', '~0').replace('/', '~1')}"
            if key in _MIN_KEYWORDS and _count(value) > threshold:
                yield SchemaProblem(here, f"{key} is {value}", key)
            elif key not in ("const", "enum", "default", "examples"):
                yield from _big_minimums(value, threshold, here)
    elif isinstance(schema, list):
        for i, value in enumerate(schema):
            yield from _big_minimums(value, threshold, f"{path}/{i}")
