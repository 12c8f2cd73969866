"""User patterns run on RE2, never on Python's backtracking `re` (grammar/regex.py and the
validator in grammar/validation.py): ECMA-262 semantics, refusals with path and reason, and a
property test over generated patterns bounding the time of every regex path."""

from __future__ import annotations

import re
import time
from contextlib import contextmanager

import jsonschema
import pytest
from hypothesis import given, settings, strategies as st

from structspec.grammar import SchemaError, check_schema, validate_instance
from structspec.grammar.regex import PatternError, compiled, search, translate
from structspec.grammar.validation import pointer

EVIL = "^(a+)+b$"
EVIL_SCHEMA = {"anyOf": [{"type": "string", "pattern": EVIL}, {"const": "a" * 60}]}  # issue 30's


class ReachedPythonRe(BaseException):  # not an Exception: no `except Exception` on the way swallows it
    pass


@contextmanager
def refused_by_python_re(*patterns: str):
    """Inside the block, handing any of `patterns` to Python's backtracking `re` (every
    re.compile / search / match / fullmatch / sub goes through re._compile) raises
    ReachedPythonRe instead of running it."""
    real = re._compile

    def spy(pattern, flags):
        if pattern in patterns:
            raise ReachedPythonRe(f"pattern {pattern!r} was handed to Python's re")
        return real(pattern, flags)

    re._compile = spy
    try:
        yield
    finally:
        re._compile = real


def least_times(*fns, rounds: int = 7, calls: int = 5) -> list[float]:
    """For each fn, the least time `calls` calls of it took over `rounds` rounds, the fns taking
    turns in each round: load on the machine only ever adds time, so the minimum is the measure
    it disturbs least, and taking turns spreads it over every fn alike."""
    best = [float("inf")] * len(fns)
    for _ in range(rounds):
        for i, fn in enumerate(fns):
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            best[i] = min(best[i], time.perf_counter() - start)
    return best


@pytest.mark.parametrize("pattern, text, matches", [
    (r"\s", "\u00a0", True),  # ECMA white space includes NBSP (RE2's \s alone does not)
    (r"\s", "\ufeff", True),
    (r"\S", "\u3000", False),
    (r"^a.b$", "a\u2028b", False),  # '.' excludes every ECMA line terminator
    (r"^a.b$", "a\rb", False),
    (r"^a.b$", "a-b", True),
    (r"^abc$", "abc\n", False),  # Python's '$' also matches before a final newline; ECMA's does not
    (r"^\d+$", "\u0663", False),  # \d is ASCII, as in ECMA
    (r"^\d+$", "042", True),
    (r"^\w+$", "caf\u00e9", False),
    (r"^caf\u00e9$", "caf\u00e9", True),
    (r"^\u{1F600}$", "\U0001f600", True),
    (r"^\cJ$", "\n", True),
    (r"^a\/b$", "a/b", True),
    (r"^(?<year>\d{4})-\d{2}$", "2026-11", True),
    (r"^[^]$", "\n", True),
    (r"[\s,]x", "\u2003x", True),
    (r"b", "abc", True),  # unanchored, as JSON Schema's pattern is
    (r"^[\b]$", "\b", True),  # in a class, \b is a backspace
    (r"^[\b]$", "b", False),
    (r"^a\0b$", "a\x00b", True),  # \0 is NUL
    (r"^\p{Script=Greek}+$", "\u03b1\u03b2", True),  # RE2 takes a property's value alone
    (r"^\p{sc=Greek}+$", "ab", False),
    (r"^\p{gc=Lu}\P{General_Category=Lu}$", "Qq", True),
    (r"^\p{L}+$", "\u00e9t\u00e9", True),
])
def test_patterns_keep_ecma_262_meaning_on_re2(pattern, text, matches):
    assert search(pattern, text) is matches


@pytest.mark.parametrize("pattern, reason", [
    (r"(?=a)b", "look-ahead and look-behind"),
    (r"a(?!b)", "look-ahead and look-behind"),
    (r"(?<=a)b", "look-ahead and look-behind"),
    (r"(?<!a)b", "look-ahead and look-behind"),
    (r"(a)\1", "back-reference \\1"),
    (r"(?<n>a)\k<n>", "named back-reference"),
    (r"(a", "missing )"),
    (r"a{2,1}", "invalid repetition size"),
    (r"a{5000}", "invalid repetition size"),
    ("[]", "an empty class"),
    ("\\u12", "invalid escape"),
    ("a\\", "lone backslash"),
    (r"\p{Foo=Bar}", "unsupported property"),
    (r"\p{Greek", "unterminated property escape"),
])
def test_what_re2_cannot_run_is_refused_with_the_reason(pattern, reason):
    with pytest.raises(PatternError, match=re.escape(reason)):
        compiled(pattern)


def test_registration_names_the_path_and_the_reason_of_a_bad_pattern():
    schema = {"type": "object", "properties": {"code": {"type": "string", "pattern": "(?=a)b"}},
              "patternProperties": {"x/(": {"type": "integer"}}}
    with pytest.raises(SchemaError) as e:
        check_schema(schema)
    problems = {p.path: p for p in e.value.problems}
    assert set(problems) == {"/properties/code/pattern", "/patternProperties/x~1("}
    assert problems["/properties/code/pattern"].keyword == "pattern"
    assert "look-ahead" in problems["/properties/code/pattern"].message
    assert "missing )" in problems["/patternProperties/x~1("].message


def test_a_regex_the_grammar_engine_refuses_names_its_path_and_reason():
    # valid on RE2 after translation (\cA is U+0001) but not in the grammar engine's dialect
    with pytest.raises(SchemaError) as e:
        check_schema({"type": "object", "properties": {"x": {"type": "string", "pattern": r"\cA"}}})
    [problem] = e.value.problems
    assert problem.path == "/properties/x/pattern" and problem.keyword == "pattern"
    assert "unrecognized escape sequence" in problem.message


def test_data_named_pattern_is_not_a_pattern():
    check_schema({"const": {"pattern": "(?=x)"}})
    check_schema({"enum": [{"pattern": "("}, 1]})
    check_schema({"type": "object", "properties": {"pattern": {"type": "string"}}})


def test_the_backtracking_schema_of_issue_30_validates_in_microseconds():
    """Issue 30's pattern on a backtracking engine (Python's re) takes time doubling with each
    `a`: 0.13 s at 22 characters, forever at 60. Here its time does not grow with the string
    (two lengths 10 characters apart, compared with a generous factor rather than against a
    clock), and no path hands it to Python's re."""
    check_schema(EVIL_SCHEMA)  # RE2 runs it: registered
    string = {"type": "string", "pattern": EVIL}
    validate_instance(string, "a")  # compiled (and cached) before any timing
    short, long = least_times(lambda: validate_instance(string, "a" * 10), lambda: validate_instance(string, "a" * 20))
    # backtracking: 2**10 = 1024 times longer at 20 characters than at 10; RE2: about the same
    assert long / short < 8, f"20 characters took {long / short:.0f} times as long as 10"

    with refused_by_python_re(EVIL):
        for n in (22, 60, 10_000):
            assert validate_instance(EVIL_SCHEMA, "a" * 60) == []
            problems = validate_instance(string, "a" * n)
            assert [p.keyword for p in problems] == ["pattern"]
        # the same through patternProperties beside additionalProperties and unevaluatedProperties
        for closing in ("additionalProperties", "unevaluatedProperties"):
            schema = {"type": "object", "patternProperties": {EVIL: {"type": "integer"}}, closing: False}
            assert [p.keyword for p in validate_instance(schema, {"a" * 60: 1})] == [closing]


def test_format_regex_is_checked_by_re2():
    schema = {"type": "string", "format": "regex"}
    assert validate_instance(schema, "^[a-z]+$") == []
    assert [p.keyword for p in validate_instance(schema, "(?=x)")] == ["format"]


def test_a_schema_stored_before_the_check_fails_validation_with_a_reason_not_an_exception():
    [problem] = validate_instance({"type": "string", "pattern": "(a)\\1"}, "aa")
    assert problem.keyword == "pattern" and "back-reference" in problem.message


def test_valid_results_agree_with_jsonschema_where_the_dialects_agree():
    schema = {"type": "object", "properties": {"zip": {"type": "string", "pattern": "^[0-9]{5}(-[0-9]{4})?$"}},
              "patternProperties": {"^x-[a-z]+$": {"type": "integer"}}, "additionalProperties": False}
    for value in ({"zip": "12345"}, {"zip": "12345-6789", "x-a": 1}, {"zip": "1234"}, {"x-1": 1}, {"x-ab": "s"}):
        oracle = jsonschema.Draft202012Validator(schema).is_valid(value)
        assert (validate_instance(schema, value) == []) is oracle, value


# --- property: every regex path of the service answers in bounded time ----------------------

TOKENS = ["a", "b", "1", "(", ")", "(?:", "|", "*", "+", "?", "{2}", "{1,3}", "{,", "[a-c]", "[^a]", "[", "]",
          r"\d", r"\w", r"\s", r"\S", ".", "^", "$", "(?=", "(?!", r"\1", r"\u0041", "\\", "-", "/", "~"]


@settings(max_examples=150, deadline=None, derandomize=True)
@given(st.lists(st.sampled_from(TOKENS), max_size=14).map("".join), st.text(alphabet="ab1 -_\n", max_size=300))
def test_generated_patterns_are_run_or_refused_naming_their_path_in_bounded_time(pattern, text):
    schema = {"type": "object", "properties": {"v": {"type": "string", "pattern": pattern}},
              "patternProperties": {pattern: {"type": "integer"}}}
    paths = {"/properties/v/pattern", pointer(("patternProperties", pattern))}
    try:
        forms = (pattern, translate(pattern))
    except PatternError:
        forms = (pattern,)
    start = time.perf_counter()
    with refused_by_python_re(*forms):  # bounded because linear: no path backtracks on it
        try:
            check_schema(schema)  # registration: meta-schema, RE2, the grammar engine's compile
        except SchemaError as e:
            assert e.problems and {p.path for p in e.problems} <= paths, e.problems
            assert all(p.keyword in ("pattern", "patternProperties") and p.message for p in e.problems)
        else:
            validate_instance(schema, {"v": text, text: text})  # result validation: pattern, patternProperties
            validate_instance({"type": "string", "format": "regex"}, pattern)
            validate_instance({"type": "object", "patternProperties": {pattern: {}}, "additionalProperties": False},
                              {text: 1})
    # 10 s: hundreds of times what an example takes (1 ms, 15 ms for the first); this asserts
    # "no hang" (a backtracking or runaway compile takes minutes), not speed
    assert time.perf_counter() - start < 10.0
