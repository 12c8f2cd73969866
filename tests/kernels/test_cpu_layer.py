"""The fused layer steps in C (kernels/cpu_layer.c) against the eager torch arithmetic they replace
(structspec/engine/lean.py), their argument checks, and the lean forward's use of them."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F
from kernel_cases import DEVICE

from kernels.cpu_layer import load
from structspec.engine.lean import rms_norm

pytestmark = pytest.mark.skipif(DEVICE.type == "cuda", reason="a CPU kernel: the GPU kit runs the CUDA ones")
DTYPES = [torch.bfloat16, torch.float32]
# widths: SmolLM2's hidden size, one that is not a multiple of the 16-lane vectors, a tiny one
WIDTHS = [576, 100, 8]
# rows: a decode row, a batch of them, a prefill chunk (split over threads)
ROWS = [1, 16, 300]


def rand(*shape, dtype, seed, scale=1.0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=gen) * scale).to(dtype)


def ulps_apart(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """How many representable values apart (same-sign finite values)."""
    bits = {torch.bfloat16: torch.int16, torch.float32: torch.int32}[got.dtype]
    return (got.view(bits).int() - want.view(bits).int()).abs()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("n", WIDTHS)
def test_add_rms_norm_adds_exactly_and_normalises_as_torch(dtype, rows, n):
    x, y = rand(rows, n, dtype=dtype, seed=1, scale=3.0), rand(rows, n, dtype=dtype, seed=2)
    w = rand(n, dtype=dtype, seed=3).abs() + 0.5
    want_x = x + y
    want = rms_norm(want_x, w, 1e-5)
    got = load().add_rms_norm(x, y, w, 1e-5)
    assert torch.equal(x, want_x)  # the residual add rounds as torch's
    # the mean of squares sums in another order: a last-bit difference of fp32, which in bf16
    # moves a value by one unit only where it sits on a rounding boundary
    apart = ulps_apart(got, want)
    if dtype == torch.bfloat16:
        assert apart.max() <= 1 and (apart > 0).float().mean() <= 0.01
    else:
        assert ((got - want).abs() <= 1e-6 * want.abs() + 1e-7).all()
    alone = rand(rows, n, dtype=dtype, seed=4)
    before = alone.clone()
    assert ((load().add_rms_norm(alone, None, w, 1e-6).float() - rms_norm(before, w, 1e-6).float()).abs()
            <= 1e-2 * rms_norm(before, w, 1e-6).float().abs() + 1e-6).all()
    assert torch.equal(alone, before)  # without y, x is only read


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("heads, dim, extra", [(12, 64, 3 * 64), (3, 40, 0), (5, 8, 16)])
def test_rotary_is_torchs_bit_for_bit_and_leaves_the_other_columns(dtype, rows, heads, dim, extra):
    qkv = rand(rows, heads * dim + extra, dtype=dtype, seed=5)
    angles = torch.arange(rows)[:, None].float() * (1.0 / 10000 ** (torch.arange(0, dim, 2).float() / dim))[None]
    angles = torch.cat((angles, angles), dim=-1)
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    qk = qkv[:, :heads * dim].view(rows, heads, dim)
    half = dim // 2
    want = qk * cos[:, None] + torch.cat((-qk[..., half:], qk[..., :half]), dim=-1) * sin[:, None]
    got = qkv.clone()
    load().rotary_(got, cos, sin, heads, dim)
    assert torch.equal(got[:, :heads * dim].view(rows, heads, dim), want)
    assert torch.equal(got[:, heads * dim:], qkv[:, heads * dim:])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("n", [1536, 100, 8])
def test_silu_mul_matches_torch(dtype, rows, n):
    gate_up = rand(rows, 2 * n, dtype=dtype, seed=6, scale=4.0)
    gate_up[0, :4] = torch.tensor([-100.0, -90.0, 0.0, 90.0], dtype=dtype)[:min(4, n)]  # exp's clamped range
    want = F.silu(gate_up[:, :n]) * gate_up[:, n:]
    got = load().silu_mul(gate_up)
    assert got.shape == (rows, n) and got.dtype == dtype
    # torch's silu(-90) is -90 / (1 + inf) = -0; here x e^x / (1 + e^x), ~-7e-38: equal below 1e-30
    tiny = want.float().abs() < 1e-30
    assert (got.float()[tiny].abs() < 1e-30).all()
    if dtype == torch.bfloat16:  # SiLU's own exp, within 2 ulp of fp32: one bf16 unit at a boundary
        apart = ulps_apart(got, want)[~tiny]
        assert apart.max() <= 1 and (apart > 0).float().mean() <= 0.01
    else:
        assert ((got - want).abs() <= 2e-6 * want.abs() + 1e-30).all()


def test_strided_rows_and_thread_counts():
    """Rows of a wider tensor (a view with a row stride), and 1 or 2 threads give the same bytes."""
    ops = load()
    base = rand(400, 700, dtype=torch.bfloat16, seed=7)
    x = base[:, 50:626]
    assert not x.is_contiguous()
    y = rand(400, 576, dtype=torch.bfloat16, seed=8)
    w = rand(576, dtype=torch.bfloat16, seed=9)
    outs = []
    for threads in (1, 2):
        xs = x.clone() if threads == 1 else x
        outs.append((ops.add_rms_norm(xs, y, w, 1e-5, threads=threads), xs.clone()))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
    assert torch.equal(base[:, :50], rand(400, 700, dtype=torch.bfloat16, seed=7)[:, :50])  # outside the view: untouched
    gate_up = base[:, :600]
    assert torch.equal(ops.silu_mul(gate_up, threads=1), ops.silu_mul(gate_up, threads=2))
    assert torch.equal(ops.silu_mul(gate_up), ops.silu_mul(gate_up.contiguous()))


def test_bad_arguments_are_named():
    ops = load()
    x = torch.zeros(4, 16, dtype=torch.bfloat16)
    w = torch.ones(16, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="x must be fp32 or bf16, got torch.float16"):
        ops.add_rms_norm(x.half(), None, w.half(), 1e-5)
    with pytest.raises(ValueError, match="y must be torch.bfloat16, got torch.float32"):
        ops.add_rms_norm(x, x.float(), w, 1e-5)
    with pytest.raises(ValueError, match="differ in shape"):
        ops.add_rms_norm(x, x[:2], w, 1e-5)
    with pytest.raises(ValueError, match="weight must be contiguous torch.bfloat16 \\[16\\]"):
        ops.add_rms_norm(x, None, w[:8], 1e-5)
    with pytest.raises(ValueError, match="unit last stride"):
        ops.add_rms_norm(x.t(), None, torch.ones(4, dtype=torch.bfloat16), 1e-5)
    with pytest.raises(ValueError, match="do not fit rows of 16"):
        ops.rotary_(x, x[:, :8], x[:, :8], 3, 8)
    with pytest.raises(ValueError, match="cos must be \\[4, 8\\]"):
        ops.rotary_(x, x[:, :4], x[:, :8], 2, 8)
    with pytest.raises(ValueError, match="width 15 is odd"):
        ops.silu_mul(x[:, :15])


def test_no_compiler_is_a_clear_error(monkeypatch, tmp_path):
    monkeypatch.setenv("CC", "no-such-cc")
    with pytest.raises(RuntimeError, match="no C compiler \\('no-such-cc' not found; set CC\\)"):
        load(tmp_path)


def llama(dtype):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(3)
    cfg = LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    return LlamaForCausalLM(cfg).eval().to(dtype)


def prefill_and_decode(runner):
    """Logits of a 12-token first chunk, then of a 3-row verification step over it."""
    from structspec.engine.kv_cache import Segment
    from structspec.engine.runner import StepInputs

    slot = runner.make_slot(32)
    ids = torch.arange(15) * 17 % 299 + 1
    first = runner.forward(StepInputs(ids[:12], torch.arange(12), [Segment(slot, 0, 12, 0)], torch.arange(12)))
    rest = runner.forward(StepInputs(ids[12:], torch.arange(12, 15), [Segment(slot, 0, 3, 12)], torch.arange(3)))
    return torch.cat([first, rest]).float()


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_lean_forward_runs_them_with_the_native_attention_and_agrees(dtype, tmp_path):
    from structspec.engine.runner import make_runner

    model = llama(dtype)
    fused = make_runner(model, "auto", lean=True, pack=True, cache_dir=tmp_path)
    assert fused.attention == "native" and fused.lean is not None and fused.lean.ops is not None
    assert list(tmp_path.glob("cpu_layer_*.so"))  # built where the engine was told
    got = prefill_and_decode(fused)
    fused.lean.ops = None  # the same forward with the eager steps
    want = prefill_and_decode(fused)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    assert (got - want).abs().max() <= tolerance * want.abs().max()
    assert make_runner(model, "torch", lean=True).lean.ops is None  # "torch" keeps every step in torch


def test_a_failing_build_or_check_keeps_the_eager_steps(monkeypatch, caplog, tmp_path):
    import kernels.cpu_layer
    from structspec.engine.runner import make_runner

    model = llama(torch.bfloat16)
    monkeypatch.setenv("CC", "no-such-cc")
    with caplog.at_level(logging.WARNING, logger="structspec.engine.runner"):
        runner = make_runner(model, "auto", lean=True, cache_dir=tmp_path / "empty")
    # no compiler: neither C library builds, and the whole forward stays in torch
    assert runner.attention == "torch" and runner.lean is not None and runner.lean.ops is None
    monkeypatch.delenv("CC")
    real = kernels.cpu_layer.LayerOps.silu_mul
    monkeypatch.setattr(kernels.cpu_layer.LayerOps, "silu_mul", lambda self, gu, threads=None: real(self, gu) + 1.0)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="structspec.engine.runner"):
        runner = make_runner(model, "auto", lean=True, cache_dir=tmp_path)
    assert runner.attention == "native" and runner.lean is not None and runner.lean.ops is None
    assert "the fused layer steps failed the check" in caplog.text


def test_the_engine_says_which_layer_steps_it_runs(tiny_normal_loaded):
    from structspec.engine.engine import Engine

    engine = Engine(tiny_normal_loaded)  # kernel_backend auto, on a CPU
    assert engine.forward_name == "lean" and engine.runner.attention == "native" and engine.layer_steps == "fused"
    assert Engine(tiny_normal_loaded, kernel_backend="torch").layer_steps == "torch"
