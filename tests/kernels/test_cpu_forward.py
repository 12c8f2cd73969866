"""The layer loop in C (kernels/cpu_forward.c): the Python loop's logits bit for bit, a plan that
follows changed weights, its argument checks, and the engine's fallbacks."""

from __future__ import annotations

import logging

import pytest
import torch
from kernel_cases import DEVICE
from test_cpu_layer import llama
from test_cpu_linear import ENGINE_PICKS_F32, ENGINE_PICKS_IT, HAS_KERNEL, needs_dpbf16

from structspec.kernels import cpu_linear
from tests.unit.engine.test_lean import some_rows_match_all_rows, steps

pytestmark = [pytest.mark.skipif(DEVICE.type == "cuda", reason="a CPU kernel: the GPU kit runs the CUDA ones"),
              pytest.mark.skipif(not HAS_KERNEL, reason="the loop runs the native linear kernel, which needs "
                                 "AVX-512F or AVX2 with FMA (test_cpu_linear checks its refusal elsewhere)")]


def runner_for(model, cache):
    """The lean runner with every native kernel, built under `cache`/kernels as an Engine would."""
    from structspec.engine.runner import make_runner

    kernels = cache / "kernels"
    return make_runner(model, "auto", lean=True, pack=True, cache_dir=kernels, linear=cpu_linear.load(kernels))


def passes(runner):
    """test_lean's three passes over three sequences, the first prompt's chunk 70 rows: more than
    the native attention's 64-row work items, so it is split into two."""
    return steps(runner, first=70)


# the loop's dtypes: fp32 wherever the linear kernel builds, bf16 where it has AVX512-BF16
DTYPES = [torch.float32, pytest.param(torch.bfloat16, marks=needs_dpbf16)]


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_c_loop_gives_the_python_loops_logits_bit_for_bit(shared_cache, dtype):
    runner = runner_for(llama(dtype), shared_cache)
    lean = runner.lean
    assert runner.attention == "native" and lean.ops is not None and lean.layer_loop is not None
    assert all(m.uses_native() for m in lean._gemms) and lean.loops_natively()
    got = passes(runner)
    assert lean._plan is not None and lean._plan.dtype == dtype  # the passes went through the C loop
    lean.layer_loop = None
    want = passes(runner)
    assert lean._plan is not None  # (not planned again: the Python loop made these)
    assert [g.dtype for g in got] == [dtype] * 3
    for g, w in zip(got, want):
        assert torch.equal(g, w)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("loop", ["c", "python"])
def test_the_last_layer_runs_only_the_rows_asked_for_with_the_same_bits(shared_cache, dtype, loop):
    """A pass asked for some rows' logits runs its last layer's o projection and MLP over those
    rows alone (in C, or in the Python loop over the same kernels): the same bits as the full
    pass's at those rows wherever the engine runs this loop in that dtype (bf16 on CPUs with
    AVX512-BF16; fp32 on CPUs with no bf16 units); elsewhere (fp32 asked for on a bf16 CPU, which
    `auto` never runs) within fp32's last bits: on AMX hosts some fp32 sums depend on the row
    count. The passes after it agree too (tests/unit/engine/test_lean.py)."""
    model = llama(dtype)

    def make():
        runner = runner_for(model, shared_cache)
        if loop == "python":
            runner.lean.layer_loop = None
        return runner

    some_rows_match_all_rows(make, exact=dtype == torch.bfloat16 or ENGINE_PICKS_F32)


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_plan_follows_a_weight_changed_in_place(shared_cache, dtype):
    runner = runner_for(llama(dtype), shared_cache)
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
def test_bad_arguments_are_refused_saying_what_is_wrong(shared_cache):
    runner = runner_for(llama(torch.bfloat16), shared_cache)
    lean = runner.lean
    passes(runner)
    plan, loop = lean._plan, lean.layer_loop
    cos = sin = torch.zeros(4, 16, dtype=torch.bfloat16)
    table = torch.zeros(2 * 3 + 4, 1, dtype=torch.int64)
    with pytest.raises(ValueError, match=r"x must be contiguous torch.bfloat16 \[T, 64\], got torch.float32"):
        loop.run(plan, torch.zeros(4, 64), cos, sin, table, torch.bfloat16, 0.25)
    with pytest.raises(ValueError, match=r"cos must be torch.bfloat16 \[4, 16\]"):
        loop.run(plan, torch.zeros(4, 64, dtype=torch.bfloat16), cos[:3], sin, table, torch.bfloat16, 0.25)
    with pytest.raises(ValueError, match=r"table must be contiguous int64 \[2 \* layers \+ 4, S\]"):
        loop.run(plan, torch.zeros(4, 64, dtype=torch.bfloat16), cos, sin, table[:5], torch.bfloat16, 0.25)
    x = torch.zeros(4, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="out_rows must index the 4 rows"):
        loop.run(plan, x, cos, sin, table, torch.bfloat16, 0.25, torch.tensor([0, 4]))
    with pytest.raises(ValueError, match=r"out_rows must be a contiguous int64 vector, got torch.float32"):
        loop.run(plan, x, cos, sin, table, torch.bfloat16, 0.25, torch.tensor([0.0]))
    with pytest.raises(ValueError, match="no layers"):
        loop.plan(lean.linear, lean.ops, runner.native, [], 4, 2, 96)


def test_an_fp32_plan_refuses_bf16_rows_and_bf16_kv(shared_cache):
    runner = runner_for(llama(torch.float32), shared_cache)
    lean = runner.lean
    passes(runner)
    plan, loop = lean._plan, lean.layer_loop
    cos = sin = torch.zeros(4, 16)
    table = torch.zeros(2 * 3 + 4, 1, dtype=torch.int64)
    with pytest.raises(ValueError, match=r"x must be contiguous torch.float32 \[T, 64\], got torch.bfloat16"):
        loop.run(plan, torch.zeros(4, 64, dtype=torch.bfloat16), cos, sin, table, torch.float32, 0.25)
    with pytest.raises(ValueError, match=r"cos must be torch.float32 \[4, 16\]"):
        loop.run(plan, torch.zeros(4, 64), cos.bfloat16(), sin, table, torch.float32, 0.25)
    with pytest.raises(ValueError, match="KV buffers of torch.bfloat16 for torch.float32 rows"):
        loop.run(plan, torch.zeros(4, 64), cos, sin, table, torch.bfloat16, 0.25)


@needs_dpbf16
def test_a_loop_that_fails_the_check_is_dropped_and_the_fused_steps_kept(monkeypatch, caplog, shared_cache):
    import structspec.kernels.cpu_forward

    real = structspec.kernels.cpu_forward.ForwardLayers.run
    monkeypatch.setattr(structspec.kernels.cpu_forward.ForwardLayers, "run",
                        lambda self, *args, **kwargs: real(self, *args, **kwargs) + 1.0)
    with caplog.at_level(logging.WARNING, logger="structspec.engine.runner"):
        runner = runner_for(llama(torch.bfloat16), shared_cache)
    assert "the native layer loop failed the check" in caplog.text
    assert runner.lean.layer_loop is None and runner.lean.ops is not None and not runner.lean.loops_natively()


def test_a_model_loops_in_python_where_a_gemm_is_not_the_kernels(shared_cache):
    """One GEMM left to oneDNN (or F.linear): no plan, the Python loop, the same logits as the
    Python loop of an all-native runner."""
    from structspec.engine.packed import PackedLinear

    model = llama(torch.float32)
    runner = runner_for(model, shared_cache)
    lean = runner.lean
    want = passes(runner)
    gemm = lean.layers[1].o
    assert isinstance(gemm, PackedLinear) and gemm.uses_native()
    lean.layers[1].o = torch.nn.Linear(gemm.in_features, gemm.out_features, bias=gemm.bias is not None)
    with torch.no_grad():
        lean.layers[1].o.weight.copy_(gemm.weight)
    lean._gemms = lean.linear_modules()[:-1]
    lean._plan = None
    assert not lean.loops_natively()
    got = passes(runner)
    assert lean._plan is None
    for g, w in zip(got, want):  # F.linear sums in another order than the kernel: close, not the same bits
        assert torch.allclose(g, w, atol=1e-4, rtol=1e-4)


@pytest.mark.skipif(not (ENGINE_PICKS_IT or ENGINE_PICKS_F32), reason="the engine picks the native linear kernel "
                    "(which the C loop runs) only on CPUs with AVX512-BF16 (bf16) or with no bf16 units "
                    "(fp32)")
def test_the_engine_says_where_its_layer_loop_runs(tiny_normal_loaded, shared_cache):
    from test_cpu_linear import bf16_loaded

    from structspec.engine.engine import Engine

    picked = bf16_loaded(tiny_normal_loaded) if ENGINE_PICKS_IT else tiny_normal_loaded
    assert Engine(picked, cache_dir=shared_cache).layer_loop == "native"
    assert Engine(picked, kernel_backend="torch").layer_loop == "python"
    if ENGINE_PICKS_IT:  # an fp32 model on a bf16 CPU keeps oneDNN's fp32 GEMMs
        assert Engine(tiny_normal_loaded, cache_dir=shared_cache).layer_loop == "python"


@needs_dpbf16
def test_the_c_loop_agrees_with_the_models_own_eager_forward(shared_cache):
    """Against transformers' own forward (eager operators, torch attention): within the fused
    steps' bf16 rounding (RMSNorm's and SiLU's last bits; tests/kernels/test_cpu_layer.py)."""
    from structspec.engine.runner import make_runner

    model = llama(torch.bfloat16)
    got = passes(runner_for(model, shared_cache))
    want = passes(make_runner(model, "torch"))
    for g, w in zip(got, want):
        g, w = g.float(), w.float()
        assert (g - w).abs().max() <= 2e-2 * w.abs().max()


@pytest.mark.skipif(not (ENGINE_PICKS_IT or ENGINE_PICKS_F32), reason="the engine picks the native linear kernel "
                    "(which the C loop runs) only on CPUs with AVX512-BF16 (bf16) or with no bf16 units "
                    "(fp32)")
def test_an_engine_emits_the_same_tokens_with_either_loop(tiny_normal_loaded, monkeypatch, shared_cache):
    """Documents of one schema (their prompts share a cached prefix, which the attention reads
    from one copy), drafted and not, four at a time: the same tokens, since the logits are the
    same bits."""
    import structspec.kernels.cpu_forward
    from test_cpu_linear import bf16_loaded

    from bench.exactness import bounded
    from structspec.engine.engine import Engine, Request
    from structspec.options import RequestOptions
    from tests.conftest import deepjsoneval_rows

    rows = deepjsoneval_rows(6)
    schema = bounded(rows[0]["schema"])
    requests = [Request(schema, row["text"], RequestOptions(strategy=("none", "composite")[i % 2], draft_len=4,
                                                            max_tokens=48, verbatim=True))
                for i, row in enumerate(rows)]
    loaded = bf16_loaded(tiny_normal_loaded) if ENGINE_PICKS_IT else tiny_normal_loaded  # fp32 on a CPU without bf16
    tables = []
    real = structspec.kernels.cpu_forward.ForwardLayers.run
    monkeypatch.setattr(structspec.kernels.cpu_forward.ForwardLayers, "run",
                        lambda self, plan, x, cos, sin, table, *a, **k: tables.append(table.shape[0]) or
                        real(self, plan, x, cos, sin, table, *a, **k))
    in_c = Engine(loaded, engine_max_seqs=4, cache_dir=shared_cache)
    assert in_c.layer_loop == "native"
    got = in_c.run(requests)
    layers = loaded.model.config.num_hidden_layers
    assert 4 * layers + 6 in tables  # some passes read a shared prefix entry
    in_python = Engine(loaded, engine_max_seqs=4, cache_dir=shared_cache)
    in_python.runner.lean.layer_loop = None
    assert in_python.layer_loop == "python"
    want = in_python.run(requests)
    assert [r.tokens for r in got] == [r.tokens for r in want]
    assert sum(len(r.tokens) for r in got) > 6 * 20  # the runs did real work
