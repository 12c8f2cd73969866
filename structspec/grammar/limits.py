"""Limits on what a schema may cost: its shape (nesting depth, number of objects and arrays) and
the grammar engine's resource limits (llguidance ParserLimits), each named by its setting.

Torch-free: the API checks these at registration.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, fields
from typing import Any

from structspec.grammar.base import SchemaError, SchemaProblem
from structspec.grammar.validation import pointer


class SchemaLimitExceeded(SchemaError):
    """A schema over one of the configured limits; `setting` names it (a Settings field)."""

    def __init__(self, setting: str, problems: list[SchemaProblem]):
        super().__init__(problems)
        self.setting = setting


@dataclass(frozen=True)
class GrammarLimits:
    """llguidance's ParserLimits, under the names of their settings (defaults: llguidance's)."""

    grammar_max_size: int = 500_000
    grammar_initial_lexer_fuel: int = 1_000_000
    grammar_step_lexer_fuel: int = 200_000
    grammar_step_max_items: int = 50_000
    grammar_max_items_in_row: int = 2_000
    grammar_max_lexer_states: int = 250_000

    @classmethod
    def from_settings(cls, settings) -> "GrammarLimits":
        return cls(**{f.name: getattr(settings, f.name) for f in fields(cls)})

    def llguidance(self):
        from llguidance import LLParserLimits

        return LLParserLimits(max_grammar_size=self.grammar_max_size,
                              initial_lexer_fuel=self.grammar_initial_lexer_fuel,
                              step_lexer_fuel=self.grammar_step_lexer_fuel,
                              step_max_items=self.grammar_step_max_items,
                              max_items_in_row=self.grammar_max_items_in_row,
                              max_lexer_states=self.grammar_max_lexer_states,
                              verbose_errors=False)


# llguidance's messages for a grammar over a limit -> the setting that raises it.
_LIMIT_MESSAGES = [
    (re.compile(r"grammar size \(number of symbols\) too big"), "grammar_max_size"),
    (re.compile(r"initial lexer configuration \(grammar\) too big"), "grammar_initial_lexer_fuel"),
    (re.compile(r"lexer fuel|fuel exhausted|too many expressions constructed", re.I), "grammar_step_lexer_fuel"),
    (re.compile(r"max_items_in_row|too many items in a row|current row has \d+ items; max is", re.I),
     "grammar_max_items_in_row"),
    (re.compile(r"step_max_items|too many Earley items|parser too complex|too many items \(limit", re.I),
     "grammar_step_max_items"),
    (re.compile(r"lexer states|lexer too complex|too many states", re.I), "grammar_max_lexer_states"),
]


def limit_setting(message: str) -> str | None:
    """The setting whose limit an llguidance error message reports, if it reports one."""
    for pattern, setting in _LIMIT_MESSAGES:
        if pattern.search(message):
            return setting
    return None


def check_shape(schema: Any, max_depth: int, max_nodes: int) -> None:
    """Raise SchemaLimitExceeded if `schema` nests deeper than `max_depth` JSON levels (the
    schema object is level 1) or holds more than `max_nodes` objects and arrays. Iterative, so
    any depth the body decoder accepted is measured without recursion."""
    nodes = 0
    stack: list[tuple[Any, tuple]] = [(schema, ())]
    while stack:
        value, path = stack.pop()
        if not isinstance(value, (dict, list)):
            continue
        nodes += 1
        depth = len(path) + 1
        if max_depth and depth > max_depth:
            raise SchemaLimitExceeded("max_schema_depth", [SchemaProblem(
                pointer(path), f"the schema nests deeper than {max_depth} levels of JSON here "
                               f"(level {depth}; setting max_schema_depth)", None)])
        if max_nodes and nodes > max_nodes:
            raise SchemaLimitExceeded("max_schema_nodes", [SchemaProblem(
                "", f"the schema has more than {max_nodes} JSON objects and arrays "
                    f"(subschemas, property maps, lists; setting max_schema_nodes)", None)])
        items = value.items() if isinstance(value, dict) else enumerate(value)
        stack.extend((child, path + (key,)) for key, child in items)
