"""The layer loop in C (kernels/cpu_forward.c): the Python loop's logits bit for bit, a plan that
follows changed weights, its argument checks, and the engine's fallbacks."""

from __future__ import annotations

import logging

import pytest
import torch
from kernel_cases import DEVICE
from test_cpu_layer import llama
from test_cpu_linear import ENGINE_PICKS_IT, HAS_KERNEL, needs_dpbf16

from kernels import cpu_linear
from tests.unit.engine.test_lean import steps

pytestmark = [pytest.mark.skipif(DEVICE.type == "cuda", reason="a CPU kernel: the GPU kit runs the CUDA ones"),
              pytest.mark.skipif(not HAS_KERNEL, reason="the loop runs the native linear kernel, which needs "
                                 "AVX-512F or AVX2 with FMA (test_cpu_linear checks its refusal elsewhere)")]


def runner_for(model, tmp_path):
    from structspec.engine.runner import make_runner

    return make_runner(model, "auto", lean=True, pack=True, cache_dir=tmp_path, linear=cpu_linear.load(tmp_path))


def passes(runner):
    """test_lean's three passes over three sequences, the first prompt's chunk 70 rows: more than
    the native attention's 64-row work items, so it is split into two."""
    return steps(runner, first=70)


@needs_dpbf16
def test_the_c_loop_gives_the_python_loops_logits_bit_for_bit(tmp_path):
    runner = runner_for(llama(torch.bfloat16), tmp_path)
    lean = runner.lean
    assert runner.attention == "native" and lean.ops is not None and lean.layer_loop is not None
    assert lean.loops_natively()
    got = passes(runner)
    assert lean._plan is not None  # the passes went through the C loop
    lean.layer_loop = None
    want = passes(runner)
    assert [g.dtype for g in got] == [torch.bfloat16] * 3
    for g, w in zip(got, want):
        assert torch.equal(g, w)


@needs_dpbf16
def test_the_plan_follows_a_weight_changed_in_place(tmp_path):
    runner = runner_for(llama(torch.bfloat16), tmp_path)
    lean, loop = runner.lean, runner.lean.layer_loop
    before = passes(runner)
    plan = lean._plan
    with torch.no_grad():
        lean.layers[1].gate_up.weight.mul_(0.5)  # the model's own weight: its packing is stale now
    got = passes(runner)
    assert lean._plan is not plan  # packed again, planned again
    lean.layer_loop = None
    want = passes(runner)
    lean.layer_loop = loop
    for g, w, b in zip(got, want, before):
        assert torch.equal(g, w) and not torch.equal(g, b)


@needs_dpbf16
def test_bad_arguments_are_refused_saying_what_is_wrong(tmp_path):
    runner = runner_for(llama(torch.bfloat16), tmp_path)
    lean = runner.lean
    passes(runner)
    plan, loop = lean._plan, lean.layer_loop
    cos = sin = torch.zeros(4, 16, dtype=torch.bfloat16)
    table = torch.zeros(2 * 3 + 4, 1, dtype=torch.int64)
    with pytest.raises(ValueError, match=r"x must be contiguous bf16 \[T, 64\], got torch.float32"):
        loop.run(plan, torch.zeros(4, 64), cos, sin, table, torch.bfloat16, 0.25)
    with pytest.raises(ValueError, match=r"cos must be bf16 \[4, 16\]"):
        loop.run(plan, torch.zeros(4, 64, dtype=torch.bfloat16), cos[:3], sin, table, torch.bfloat16, 0.25)
    with pytest.raises(ValueError, match=r"table must be contiguous int64 \[2 \* layers \+ 4, S\]"):
        loop.run(plan, torch.zeros(4, 64, dtype=torch.bfloat16), cos, sin, table[:5], torch.bfloat16, 0.25)
    with pytest.raises(ValueError, match="no layers"):
        loop.plan(lean.linear, lean.ops, runner.native, [], 4, 2, 96)


@needs_dpbf16
def test_a_loop_that_fails_the_check_is_dropped_and_the_fused_steps_kept(monkeypatch, caplog, tmp_path):
    import kernels.cpu_forward

    real = kernels.cpu_forward.ForwardLayers.run
    monkeypatch.setattr(kernels.cpu_forward.ForwardLayers, "run",
                        lambda self, *args, **kwargs: real(self, *args, **kwargs) + 1.0)
    with caplog.at_level(logging.WARNING, logger="structspec.engine.runner"):
        runner = runner_for(llama(torch.bfloat16), tmp_path)
    assert "the native layer loop failed the check" in caplog.text
    assert runner.lean.layer_loop is None and runner.lean.ops is not None and not runner.lean.loops_natively()


def test_fp32_models_loop_in_python(tmp_path):
    """The C layer loop is bf16: an fp32 model's GEMMs (oneDNN's, or the native kernel's fp32 on a
    CPU with no bf16 units) loop in Python, so no plan."""
    runner = runner_for(llama(torch.float32), tmp_path)
    assert all(m.uses_native() for m in runner.lean._gemms)  # every GEMM the kernel's, in fp32
    passes(runner)
    assert not runner.lean.loops_natively() and runner.lean._plan is None


@pytest.mark.skipif(not ENGINE_PICKS_IT, reason="the engine picks the native linear kernel (which the C loop "
                    "runs) only on CPUs with AVX512-BF16 and no AMX")
def test_the_engine_says_where_its_layer_loop_runs(tiny_normal_loaded, tmp_path):
    from test_cpu_linear import bf16_loaded

    from structspec.engine.engine import Engine

    assert Engine(bf16_loaded(tiny_normal_loaded), cache_dir=tmp_path).layer_loop == "native"
    assert Engine(bf16_loaded(tiny_normal_loaded), kernel_backend="torch").layer_loop == "python"
    assert Engine(tiny_normal_loaded, cache_dir=tmp_path).layer_loop == "python"  # fp32


@needs_dpbf16
def test_the_c_loop_agrees_with_the_models_own_eager_forward(tmp_path):
    """Against transformers' own forward (eager operators, torch attention): within the fused
    steps' bf16 rounding (RMSNorm's and SiLU's last bits; tests/kernels/test_cpu_layer.py)."""
    from structspec.engine.runner import make_runner

    model = llama(torch.bfloat16)
    got = passes(runner_for(model, tmp_path))
    want = passes(make_runner(model, "torch"))
    for g, w in zip(got, want):
        g, w = g.float(), w.float()
        assert (g - w).abs().max() <= 2e-2 * w.abs().max()


@pytest.mark.skipif(not ENGINE_PICKS_IT, reason="the engine picks the native linear kernel (which the C loop "
                    "runs) only on CPUs with AVX512-BF16 and no AMX")
def test_an_engine_emits_the_same_tokens_with_either_loop(tiny_normal_loaded, monkeypatch, tmp_path):
    """Documents of one schema (their prompts share a cached prefix, which the attention reads
    from one copy), drafted and not, four at a time: the same tokens, since the logits are the
    same bits."""
    import kernels.cpu_forward
    from test_cpu_linear import bf16_loaded

    from structspec.bench.exactness import bounded
    from structspec.engine.engine import Engine, Request
    from structspec.options import RequestOptions
    from tests.conftest import deepjsoneval_rows

    rows = deepjsoneval_rows(6)
    schema = bounded(rows[0]["schema"])
    requests = [Request(schema, row["text"], RequestOptions(strategy=("none", "composite")[i % 2], draft_len=4,
                                                            max_tokens=48, verbatim=True))
                for i, row in enumerate(rows)]
    loaded = bf16_loaded(tiny_normal_loaded)
    tables = []
    real = kernels.cpu_forward.ForwardLayers.run
    monkeypatch.setattr(kernels.cpu_forward.ForwardLayers, "run",
                        lambda self, plan, x, cos, sin, table, *a, **k: tables.append(table.shape[0]) or
                        real(self, plan, x, cos, sin, table, *a, **k))
    in_c = Engine(loaded, engine_max_seqs=4, cache_dir=tmp_path)
    assert in_c.layer_loop == "native"
    got = in_c.run(requests)
    layers = loaded.model.config.num_hidden_layers
    assert 4 * layers + 6 in tables  # some passes read a shared prefix entry
    in_python = Engine(loaded, engine_max_seqs=4, cache_dir=tmp_path)
    in_python.runner.lean.layer_loop = None
    assert in_python.layer_loop == "python"
    want = in_python.run(requests)
    assert [r.tokens for r in got] == [r.tokens for r in want]
    assert sum(len(r.tokens) for r in got) > 6 * 20  # the runs did real work
