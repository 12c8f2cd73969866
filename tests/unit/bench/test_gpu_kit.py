"""The GPU kit (structspec/bench/gpu.py), tested here before any GPU is lent: the calls it
plans fit the device tool's limit, the model parts reassemble, the check imports nothing the
lent image and the bundle lack, and its timing stages run end to end on a CPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from structspec.bench import gpu

ROOT = Path(__file__).resolve().parents[3]
MiB = gpu.MiB


def test_every_planned_call_fits_and_the_first_carries_the_wheels():
    calls = gpu.plan_calls(tree=2 * MiB, wheels=7 * MiB, model=94 * MiB)
    assert sum(calls) == 94 * MiB
    assert 2 * MiB + 7 * MiB + calls[0] <= gpu.CALL_LIMIT - 2 * MiB
    assert all(2 * MiB + c <= gpu.CALL_LIMIT - 2 * MiB for c in calls[1:])
    assert len(calls) == 2


def test_a_plan_with_no_room_says_why():
    with pytest.raises(ValueError, match="leave no room"):
        gpu.plan_calls(tree=30 * MiB, wheels=40 * MiB, model=10 * MiB)


def test_the_model_parts_reassemble_byte_for_byte(tmp_path):
    blob = bytes(range(256)) * 1000 + b"tail"
    src = tmp_path / "m.gguf"
    src.write_bytes(blob)
    parts = gpu.split_file(src, tmp_path / "parts", first=70_000, rest=100_000)
    assert [p.stat().st_size for p in parts] == [70_000, 100_000, 86_004]
    assert b"".join(p.read_bytes() for p in sorted(parts)) == blob


def test_the_last_call_assembles_the_parts_and_runs_the_check():
    first, last = gpu.stage_command(".gpu", "model.gguf.part00", False), gpu.stage_command(".gpu", "x", True)
    assert "pip install" in first and "--target /tmp/gpukit/site" in first and "structspec.bench.gpu" not in first
    assert "cat /tmp/gpukit/model/model.gguf.part* > /tmp/gpukit/model.gguf" in last
    assert "check --device cuda --tokenizer /tmp/gpukit/tokenizer --gguf /tmp/gpukit/model.gguf" in last


def test_the_timing_stages_run_on_a_cpu_importing_only_what_the_lent_image_or_the_bundle_has(tokenizer, tmp_path):
    """`check` in a fresh process, as it runs there. A distribution it imports outside BUNDLED
    and IMAGE_HAS would be missing on the lent machine (sqlalchemy once came in through
    bench.batch)."""
    cmd = [sys.executable, "-m", "structspec.bench.gpu", "check", "--device", "cpu", "--stages", "pass-cost,throughput",
           "--out", str(tmp_path)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    stages = json.loads((tmp_path / "gpu-check.json").read_text())["stages"]
    assert {n: s["ok"] for n, s in stages.items()} == {"env": True, "pass-cost": True, "throughput": True,
                                                       "imports": True}
    assert stages["imports"]["missing"] == []
    assert {"llguidance", "jsonschema"} <= set(stages["imports"]["bundled"]) and "torch" in stages["imports"]["image"]
    rows = stages["pass-cost"]["rows"]
    assert {(r["sequences"], r["k"]) for r in rows} == {(1, 0), (1, 4), (4, 0), (4, 4)} and all(r["ms"] > 0 for r in rows)
    runs = stages["throughput"]["runs"]
    assert [r["max_seqs"] for r in runs] == [1, 4] and all(r["output_tokens"] > 0 for r in runs)
    assert "| max_seqs |" in (tmp_path / "gpu-check.md").read_text()


def test_an_unknown_stage_is_refused_naming_the_stages(tmp_path):
    with pytest.raises(SystemExit, match="unknown stage.*pass-cost"):
        gpu.check("cpu", tmp_path, gpu.default_model_dir(), None, small=True, stages={"warp-drive"})
