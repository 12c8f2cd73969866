"""tests/conftest.py ends a run that skipped anything with a section naming each skipped test,
its reason and a hint; a run that skipped nothing ends as pytest ends it. The project's conftest
runs in an inner pytest session (pytester), copied as it is."""

from __future__ import annotations

from pathlib import Path

pytest_plugins = ["pytester"]

CONFTEST = Path(__file__).resolve().parents[1] / "conftest.py"

SOME_SKIPPED = """
import pytest

@pytest.fixture
def broker():
    pytest.skip("RabbitMQ is not reachable (127.0.0.1:5672: Connection refused)")

def test_runs():
    pass

def test_needs_redis():
    pytest.skip("Redis is not reachable (127.0.0.1:6379: Connection refused)")

def test_needs_broker(broker):
    pass

@pytest.mark.skipif(True, reason="this CPU lacks AVX2")
def test_needs_avx2():
    pass
"""


def run_inner(pytester, source: str):
    pytester.makeconftest(CONFTEST.read_text(encoding="utf-8"))
    pytester.makepyfile(test_inner=source)
    return pytester.runpytest("-p", "no:cacheprovider", "-ra")


def test_skipped_tests_are_named_with_reason_and_hint_at_the_end(pytester):
    result = run_inner(pytester, SOME_SKIPPED)

    result.assert_outcomes(passed=1, skipped=3)
    lines = result.outlines
    header = next(i for i, line in enumerate(lines) if "3 tests SKIPPED, not run" in line)
    assert header > next(i for i, line in enumerate(lines) if "short test summary info" in line)
    section = lines[header + 1:]
    assert section[:3] == [
        "SKIPPED test_inner.py::test_needs_redis: Redis is not reachable (127.0.0.1:6379: Connection refused)",
        "SKIPPED test_inner.py::test_needs_broker: RabbitMQ is not reachable (127.0.0.1:5672: Connection refused)",
        "SKIPPED test_inner.py::test_needs_avx2: this CPU lacks AVX2",
    ]
    assert section[3].startswith("hint: start the services named above (`bash .ci/run`")
    assert "CI=true" in section[3]
    # the section is the last thing before pytest's own counts line, which CI logs keep
    assert len(section) == 5 and "1 passed, 3 skipped" in section[4]


def test_no_section_when_nothing_was_skipped(pytester):
    result = run_inner(pytester, "def test_runs():\n    pass\n\ndef test_runs_too():\n    pass\n")

    result.assert_outcomes(passed=2)
    assert not any("SKIPPED" in line or line.startswith("hint:") for line in result.outlines)
    assert "2 passed" in result.outlines[-1]
