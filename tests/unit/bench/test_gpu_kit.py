"""The GPU kit (bench/gpu.py), tested here before any GPU is lent: the calls it
plans fit the device tool's limit, the model parts reassemble, the check imports nothing the
lent image and the bundle lack, and its timing stages run end to end on a CPU."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from bench import gpu

ROOT = Path(__file__).resolve().parents[3]
MiB = gpu.MiB



@pytest.fixture(autouse=True)
def _kit_globals(monkeypatch):
    """A Report sets the kit's module-wide deadline and report folder: each test gets them back."""
    monkeypatch.setattr(gpu, "_deadline", gpu._deadline)
    monkeypatch.setattr(gpu, "_report_dir", gpu._report_dir)

def test_every_planned_call_fits_its_limit_and_the_first_carries_the_wheels():
    calls = gpu.plan_calls(tree=2 * MiB, wheels=21 * MiB, model=86 * MiB)
    assert sum(calls) == 86 * MiB and len(calls) == 2
    assert 2 * MiB + 21 * MiB + calls[0] <= 56 * MiB and 2 * MiB + calls[1] <= 60 * MiB


def test_a_plan_with_no_room_says_why():
    with pytest.raises(ValueError, match="leave no room"):
        gpu.plan_calls(tree=30 * MiB, wheels=40 * MiB, model=10 * MiB)
    with pytest.raises(ValueError, match="needs more than 2 calls"):
        gpu.plan_calls(tree=2 * MiB, wheels=21 * MiB, model=94 * MiB)


@pytest.mark.long  # builds the real bundle (wheels and the model in parts): the slowest test of `make test`
def test_the_real_bundle_sends_at_most_56_then_60_mib_and_its_model_reassembles(tmp_path):
    """Issue 32's limits on the bundle as built here: the wheels at the versions installed, the
    default tokenizer, the default model's GGUF compressed (cached: ~1 min the first time) in two
    parts. The parts, concatenated and decompressed as the last call does, are the GGUF."""
    import lzma

    summary = gpu.bundle(tmp_path / "gpu", None)
    assert gpu.over_plan(summary) == "" and len(summary["calls"]) == 2, summary["calls"]
    assert summary["calls"][0]["bytes"] <= 56 * MiB and summary["calls"][1]["bytes"] <= 60 * MiB
    parts = sorted((tmp_path / "gpu" / "model").glob("model.gguf.part*"))
    blob = lzma.decompress(b"".join(p.read_bytes() for p in parts))
    assert hashlib.sha256(blob).hexdigest() == summary["sha256"] and len(blob) == summary["model_bytes"]
    plan = (tmp_path / "gpu" / "PLAN.md").read_text()
    assert all(c["command"] in plan for c in summary["calls"])  # PLAN.md prints both calls exactly
    assert "sha256sum -c" in summary["calls"][1]["command"]


@pytest.mark.parametrize("xz_program", [True, False], ids=["xz", "python-lzma"])
def test_the_compressed_model_is_one_xz_stream_the_last_call_reads_and_is_cached(tmp_path, monkeypatch, xz_program):
    """With the `xz` program (every core) or without it (Python's lzma): the file Python's lzma
    decompresses to the GGUF's bytes, cached under its sha256 so a second bundle reuses it."""
    import lzma

    if xz_program and shutil.which("xz") is None:
        pytest.fail("the xz program is not installed here (xz-utils); the bundle would fall back to one thread")
    if not xz_program:
        real_which = shutil.which
        monkeypatch.setattr(gpu.shutil, "which", lambda name, *a, **k: None if name == "xz" else real_which(name, *a, **k))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    blob = bytes(range(256)) * 4000 + os.urandom(300_000)
    src = tmp_path / "m.gguf"
    src.write_bytes(blob)
    sha = hashlib.sha256(blob).hexdigest()
    packed = gpu.compressed_model(src, sha)
    assert packed == tmp_path / "cache" / "structspec" / "gpu-kit" / f"{sha}.gguf.xz"
    assert lzma.decompress(packed.read_bytes()) == blob and packed.stat().st_size < len(blob)
    stamp = packed.stat().st_mtime_ns
    src.write_bytes(b"not read again")
    assert gpu.compressed_model(src, sha) == packed and packed.stat().st_mtime_ns == stamp


def test_the_model_parts_reassemble_byte_for_byte(tmp_path):
    blob = bytes(range(256)) * 1000 + b"tail"
    src = tmp_path / "m.gguf"
    src.write_bytes(blob)
    parts = gpu.split_file(src, tmp_path / "parts", first=70_000, rest=100_000)
    assert [p.stat().st_size for p in parts] == [70_000, 100_000, 86_004]
    assert b"".join(p.read_bytes() for p in sorted(parts)) == blob


def test_the_first_call_runs_the_random_weight_stages_and_the_last_the_real_model_ones():
    first = gpu.stage_command(".gpu", "model.gguf.part00", first=True, last=False)
    last = gpu.stage_command(".gpu", "model.gguf.part01", first=False, last=True, gguf_sha256="ab" * 32)
    assert "pip install" in first and "--target /tmp/gpukit/site" in first
    assert f"--stages {','.join(gpu.FIRST_CALL_STAGES)}" in first and "--gguf" not in first
    assert "tee $OUT/check-1.log" in first
    assert "cat /tmp/gpukit/model/model.gguf.part* | python3 -c" in last and "> /tmp/gpukit/model.gguf" in last
    assert "check --device cuda --tokenizer /tmp/gpukit/tokenizer --gguf /tmp/gpukit/model.gguf" in last
    assert f"--stages {','.join(gpu.LAST_CALL_STAGES)}" in last and "pip install" not in last
    assert set(gpu.FIRST_CALL_STAGES) | set(gpu.LAST_CALL_STAGES) == set(gpu.STAGES)


def test_the_last_call_refuses_a_model_whose_first_part_is_gone(tmp_path):
    """The machine went back between the calls: the last call finds its own part only, and exits
    3 saying to start again, instead of running the check on a cut GGUF."""
    import lzma

    blob = bytes(range(256)) * 64 + b"".join(i.to_bytes(4, "little") for i in range(5000))
    src = tmp_path / "m.gguf.xz"
    src.write_bytes(lzma.compress(blob))
    bundle_dir = tmp_path / "bundle"
    parts = gpu.split_file(src, bundle_dir / "model", first=src.stat().st_size // 2, rest=src.stat().st_size)
    assert len(parts) == 2
    cmd = gpu.stage_command(str(bundle_dir), "model.gguf.part01", first=False, last=True,
                            gguf_sha256=hashlib.sha256(blob).hexdigest())
    cmd = cmd.replace("/tmp/gpukit", str(tmp_path / "staged"))
    proc = subprocess.run(["bash", "-c", cmd], capture_output=True, text=True, env={**os.environ, "OUT": str(tmp_path)})
    assert proc.returncode == 3 and "start again from call 1" in proc.stdout
    # with the first part staged too (the machine stayed warm), the check is reached
    (tmp_path / "staged" / "model" / "model.gguf.part00").write_bytes((bundle_dir / "model" / "model.gguf.part00")
                                                                      .read_bytes())
    proc = subprocess.run(["bash", "-c", cmd.replace("python3 -m bench.gpu check", "echo reached")],
                          capture_output=True, text=True, env={**os.environ, "OUT": str(tmp_path)})
    assert proc.returncode == 0 and "reached" in proc.stdout, proc.stdout + proc.stderr


@pytest.mark.long  # the harness's own imports; the kit's planning and report tests stay in `make test`
def test_the_timing_stages_run_on_a_cpu_importing_only_what_the_lent_image_or_the_bundle_has(tokenizer, tmp_path):
    """`check` in a fresh process, as it runs there. A distribution it imports outside BUNDLED
    and IMAGE_HAS would be missing on the lent machine (sqlalchemy once came in through
    bench.batch)."""
    cmd = [sys.executable, "-m", "bench.gpu", "check", "--device", "cpu", "--stages", "pass-cost,throughput",
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


DEVICE_COMMAND_S = 600  # the device tool's limit on one command (PLAN.md asks each call for timeout_s 600)


def planned_checks(tmp_path: Path, monkeypatch) -> list[SimpleNamespace]:
    """Each call's `check` as the plan's own commands start it: the commands stage_command writes
    for the bundle's two calls (the first carries the wheels, the last assembles the model), each
    `bench.gpu check` in them parsed by gpu.main as on the device, with `check` itself
    stubbed: the device, stages and deadline each call's check gets."""
    runs = []

    def stub(device, out, tokenizer, gguf, small, stages, deadline_s):
        runs.append(SimpleNamespace(device=device, stages=stages, deadline_s=deadline_s))
        (out / "gpu-check.md").write_text("")
        return SimpleNamespace(stages={})

    monkeypatch.setattr(gpu, "check", stub)
    monkeypatch.setenv("OUT", str(tmp_path))
    calls = [gpu.stage_command(".gpu", "model.gguf.part00", True, False),
             gpu.stage_command(".gpu", "model.gguf.part01", False, True, "0" * 64)]
    for i, command in enumerate(calls):
        [invocation] = re.findall(r"python3 -m bench\.gpu (check [^|]*)\|", command)
        assert gpu.main([t for t in shlex.split(invocation) if not t.startswith("2>")]) == 0
        assert len(runs) == i + 1, command
    return runs


def test_each_calls_stage_estimates_fit_inside_its_deadline_and_the_device_limit(tmp_path, monkeypatch):
    """The plan's arithmetic (docs/gpu.md, "Time"), on what the calls' commands actually run: each
    call's stages (from its command) sum to no more than the deadline its check gets (from
    gpu.main's defaults), which with a machine start fits the device tool's 600 s per command;
    every stage runs in exactly one call; and both calls, each with a start, fit a task's 15
    device minutes."""
    runs = planned_checks(tmp_path, monkeypatch)
    assert [r.device for r in runs] == ["cuda", "cuda"]
    assert sorted(name for r in runs for name in r.stages) == sorted(gpu.STAGES)
    for r in runs:
        assert 0 < r.deadline_s <= DEVICE_COMMAND_S - gpu.MACHINE_START_S, r
        assert sum(gpu.STAGE_ESTIMATE_S[name] for name in r.stages) <= r.deadline_s, r
    total = sum(gpu.MACHINE_START_S + sum(gpu.STAGE_ESTIMATE_S[name] for name in r.stages) for r in runs)
    assert total <= gpu.DEVICE_BUDGET_S, total


def test_a_call_runs_the_stages_that_start_before_its_deadline_and_skips_the_rest(tmp_path, monkeypatch):
    """Report's deadline on a simulated clock, each stage taking its estimated seconds: with the
    deadline the plan gives each call, every stage of the call runs and the last ends before it;
    with less (half the call's estimate, one second), the stages that would start after it are
    skipped, each saying how to run it alone."""
    runs = planned_checks(tmp_path, monkeypatch)
    now = [0.0]
    monkeypatch.setattr(gpu, "time", SimpleNamespace(monotonic=lambda: now[0], perf_counter=lambda: now[0],
                                                     sleep=time.sleep))
    monkeypatch.setattr(gpu, "report_markdown", lambda device, stages: "")

    def take(name: str) -> dict:
        now[0] += gpu.STAGE_ESTIMATE_S[name]
        return {}

    for r in runs:
        names = [name for name in gpu.STAGES if name in r.stages]
        estimate = sum(gpu.STAGE_ESTIMATE_S[name] for name in names)
        for deadline in (r.deadline_s, estimate / 2, 1):
            now[0] = 0.0
            report = gpu.Report(tmp_path / "report", "cuda", deadline)
            starts = {}
            for name in names:
                starts[name] = now[0]
                report.stage(name, lambda name=name: take(name))
            ran = [n for n in names if "skipped" not in report.stages[n]]
            assert ran == [n for n in names if starts[n] <= deadline], (deadline, report.stages)
            assert all(report.stages[n]["skipped"].endswith(f"--stages {n}") for n in names if n not in ran)
            if deadline == r.deadline_s:
                assert ran == names and now[0] <= deadline, (names, now[0], deadline)
            else:
                assert ran != names, (deadline, names)  # too little time: something is left, and said


def test_a_stage_past_the_deadline_stops_its_loop_and_says_what_it_left(monkeypatch):
    """Deadlines are checked inside the stages' loops (a stage killed mid-way by the device's
    600 s limit would write nothing): with no time left, throughput runs no batch size."""
    monkeypatch.setattr(gpu, "_deadline", 0.0)  # long past
    assert gpu.time_left() < 0 and gpu.subprocess_timeout() == 30
    monkeypatch.setattr(gpu, "random_model", lambda *a, **k: type("M", (), {"name": "stub"})())
    result = gpu.throughput_stage(None, {}, "cpu", small=True)
    assert result["runs"] == [] and "out of time before max_seqs 1" in result["truncated"]


def test_the_torch_attention_row_times_a_few_steps_of_the_largest_batch(monkeypatch):
    """The torch attention's steps are ~100x the Triton one's on a GPU (1.8 s each on the third
    H200): its row takes one document a slot and 16 tokens, where the Triton rows take two and 64
    (130 such steps once took 261 s and starved the stage after it). Stubbed runs, CUDA's sizes."""
    calls = []

    def fake_run(loaded, device, b, schema, docs, opts, backend=None, **kw):
        calls.append((b, len(docs), opts.max_tokens, backend))
        return {"max_seqs": b, "attention": backend or "triton", "tok_s": 1.0}

    monkeypatch.setattr(gpu, "random_model", lambda *a, **k: type("M", (), {"name": "stub"})())
    monkeypatch.setattr(gpu, "timed_run", fake_run)
    result = gpu.throughput_stage(None, {}, "cuda", small=False)
    assert calls == [(1, 16, 64, None), (8, 16, 64, None), (32, 64, 64, None), (64, 128, 64, None),
                     (64, 64, 16, "torch")]
    assert [r["attention"] for r in result["runs"]] == ["triton"] * 4 + ["torch"]
