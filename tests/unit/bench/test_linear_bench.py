"""bench.linear: its table with a second build of kernels/cpu_linear.c beside this one,
and its errors for bad arguments."""

from __future__ import annotations

import pytest

from bench import linear
from structspec.kernels import cpu_linear


def test_the_table_times_this_build_and_another_and_compares_their_bits(capsys):
    source = cpu_linear.SOURCE
    # fp32: the kernel every CPU it builds for serves
    linear.main(["--rows", "3,20", "--layers", "1", "--dtype", "float32", "--against", str(source)])
    lines = capsys.readouterr().out.splitlines()
    header = next(line for line in lines if line.startswith("| rows |"))
    assert "against (ms)" in header and header.count("|") == 10
    rows = [line.split("|") for line in lines if line.startswith(("| 3 |", "| 20 |"))]
    assert len(rows) == 2
    for cells in rows:
        assert float(cells[2]) > 0 and float(cells[3]) > 0 and float(cells[7]) > 0
        assert cells[8].strip().endswith("x")
        assert cells[9].strip() == "same"  # the same source built twice gives the same bits


def test_without_against_the_table_has_no_comparison(capsys):
    linear.main(["--rows", "2", "--layers", "1", "--dtype", "float32"])
    header = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("| rows |"))
    assert "against" not in header and header.count("|") == 7


def test_a_missing_against_file_is_named():
    with pytest.raises(SystemExit, match="--against: no file"):
        linear.main(["--dtype", "float32", "--against", "/nonexistent/old.c"])
