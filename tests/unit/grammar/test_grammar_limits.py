"""Schema shape limits and the grammar engine's resource limits, each named by its setting."""

from __future__ import annotations

import time

import pytest

from structspec.grammar import GrammarLimits, SchemaLimitExceeded, check_schema
from structspec.grammar.limits import check_shape, limit_setting


def nested(levels: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "array", "items": schema}
    return schema


def test_depth_limit_names_the_path_where_it_is_exceeded():
    check_shape(nested(15), max_depth=16, max_nodes=0)  # 16 objects deep: within
    with pytest.raises(SchemaLimitExceeded) as e:
        check_shape(nested(16), max_depth=16, max_nodes=0)
    assert e.value.setting == "max_schema_depth"
    [problem] = e.value.problems
    assert problem.path == "/items" * 16
    assert "16 levels" in problem.message and "max_schema_depth" in problem.message


def test_depth_counts_arrays_and_property_maps_and_is_not_recursive():
    schema = {"type": "object", "properties": {"a": {"enum": [[["x"]]]}}}  # levels 1..6
    check_shape(schema, max_depth=6, max_nodes=0)
    with pytest.raises(SchemaLimitExceeded, match="^/properties/a/enum/0/0: "):
        check_shape(schema, max_depth=5, max_nodes=0)
    with pytest.raises(SchemaLimitExceeded):  # far past Python's recursion limit
        check_shape(nested(5000), max_depth=32, max_nodes=0)


def test_node_limit_counts_objects_and_arrays():
    schema = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(10)}}
    check_shape(schema, max_depth=0, max_nodes=12)  # root, properties, 10 subschemas
    with pytest.raises(SchemaLimitExceeded) as e:
        check_shape(schema, max_depth=0, max_nodes=11)
    assert e.value.setting == "max_schema_nodes" and "11" in str(e.value)


def test_grammar_over_max_size_is_refused_naming_the_setting():
    schema = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(300)}}
    assert check_schema(schema) == []
    with pytest.raises(SchemaLimitExceeded) as e:
        check_schema(schema, GrammarLimits(grammar_max_size=1000))
    assert e.value.setting == "grammar_max_size"
    assert "grammar_max_size" in str(e.value)


def test_huge_enum_is_refused_quickly_by_the_default_lexer_fuel():
    t0 = time.monotonic()
    with pytest.raises(SchemaLimitExceeded) as e:
        check_schema({"enum": [f"value-{i}" for i in range(100_000)]})
    assert e.value.setting == "grammar_initial_lexer_fuel"
    assert time.monotonic() - t0 < 10


def test_llguidance_limit_messages_map_to_settings():
    assert limit_setting("grammar size (number of symbols) too big (limit for this grammar: 5)") == "grammar_max_size"
    assert limit_setting("initial lexer configuration (grammar) too big (limit for this grammar: 9)") == \
        "grammar_initial_lexer_fuel"
    assert limit_setting("Unimplemented keys: [\"uniqueItems\"]") is None


def test_limits_follow_the_settings():
    from structspec.config import Settings

    limits = GrammarLimits.from_settings(Settings(grammar_max_size=7, grammar_step_lexer_fuel=9))
    assert (limits.grammar_max_size, limits.grammar_step_lexer_fuel) == (7, 9)
    parser = limits.llguidance()
    assert (parser.max_grammar_size, parser.step_lexer_fuel, parser.initial_lexer_fuel) == (7, 9, 1_000_000)


# 30 overlapping branches: each token step builds rows of 30 parser items and a lexer of many states
BRANCHY = {"anyOf": [{"type": "object", "properties": {f"k{i}": {"type": "string"}}, "required": [f"k{i}"]}
                     for i in range(30)]}


@pytest.mark.parametrize("setting, value, says", [
    ("grammar_step_lexer_fuel", 50, "too many expressions constructed"),
    ("grammar_step_max_items", 10, "Too many items (limit 10"),
    ("grammar_max_items_in_row", 3, "max is 3"),
    ("grammar_max_lexer_states", 5, "too many states"),
])
def test_each_per_token_limit_fails_the_job_naming_its_setting(tiny_loaded, setting, value, says):
    """The four limits llguidance enforces per generated token (the worker compiles with them):
    set low, a job on a branchy schema stops with an error that names the setting, never runs
    on or hangs; with the defaults the same job runs to its end."""
    from structspec.engine.engine import Engine
    from structspec.options import RequestOptions

    options = RequestOptions(strategy="none", max_tokens=48)
    limited = Engine(tiny_loaded, kernel_backend="torch", **{setting: value}).extract(BRANCHY, "k3: hello", options)
    assert limited.status == "error" and limited.value is None
    assert f"grammar limit reached ({setting};" in limited.error and says in limited.error, limited.error
    unlimited = Engine(tiny_loaded, kernel_backend="torch").extract(BRANCHY, "k3: hello", options)
    assert unlimited.status in ("succeeded", "truncated"), unlimited.error
