"""bench.attention: its table on tiny steps, with a second build beside this one, and
its errors for bad arguments."""

from __future__ import annotations

import pytest

from bench import attention
from structspec.kernels import cpu_attention


def test_the_table_times_each_step_for_this_build_and_another(capsys):
    source = cpu_attention.SOURCE
    attention.main(["--shapes", "4x1@512,1x3@20", "--layers", "2", "--against", str(source)])
    lines = capsys.readouterr().out.splitlines()
    rows = [line for line in lines if line.startswith("| 4x1@512 |") or line.startswith("| 1x3@20 |")]
    assert len(rows) == 2
    # the KV a step reads: sequences x (past + rows) x layers x 3 kv heads x 64 dims x K and V x 2 bytes
    assert rows[0].split("|")[2].strip() == "3 MB"  # 4 x 513 x 2 x 3 x 64 x 2 x 2 bytes
    assert all(cell.strip().endswith("x") for cell in (r.split("|")[-3] for r in rows))
    # the same source built twice writes the same outputs, bit for bit
    assert [r.split("|")[-2].strip() for r in rows] == ["same", "same"]


def test_fp32_steps_read_four_bytes_a_value(capsys):
    attention.main(["--shapes", "4x1@512", "--layers", "2", "--dtype", "float32"])
    row = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("| 4x1@512 |"))
    assert row.split("|")[2].strip() == "6 MB"  # 4 x 513 x 2 x 3 x 64 x 2 x 4 bytes
    assert float(row.split("|")[3]) > 0


@pytest.mark.parametrize("argv, message", [
    (["--shapes", "16by1"], "is not SEQSxROWS@PAST"),
    (["--shapes", "0x1@5"], "needs at least one sequence"),
    (["--against", "/nonexistent/old.c"], "no file"),
])
def test_bad_arguments_are_named(argv, message):
    with pytest.raises(SystemExit, match=message):
        attention.main(argv)
