"""The fused layer steps in C (kernels/cpu_layer.c) against the eager torch arithmetic they replace
(structspec/engine/lean.py), their argument checks, and the lean forward's use of them."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F
from kernel_cases import DEVICE

from structspec.kernels.cpu_layer import load
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


def test_unchecked_calls_compute_the_same_bytes():
    """check=False (the lean forward's layers after the first) skips only the argument checks."""
    ops = load()
    for dtype in DTYPES:
        x, y = rand(9, 576, dtype=dtype, seed=1), rand(9, 576, dtype=dtype, seed=2)
        w = rand(576, dtype=dtype, seed=3)
        x2 = x.clone()
        assert torch.equal(ops.add_rms_norm(x, y, w, 1e-5), ops.add_rms_norm(x2, y, w, 1e-5, check=False))
        assert torch.equal(x, x2)
        qk, cos, sin = rand(9, 960, dtype=dtype, seed=4), rand(9, 64, dtype=dtype, seed=5), rand(9, 64, dtype=dtype, seed=6)
        qk2 = qk.clone()
        ops.rotary_(qk, cos, sin, 12, 64)
        ops.rotary_(qk2, cos, sin, 12, 64, check=False)
        assert torch.equal(qk, qk2)
        gate_up = rand(9, 3072, dtype=dtype, seed=7)
        assert torch.equal(ops.silu_mul(gate_up), ops.silu_mul(gate_up, check=False))
    with pytest.raises(ValueError, match="width 15 is odd"):  # the checked call still checks
        ops.silu_mul(torch.zeros(4, 15, dtype=torch.bfloat16))


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


@pytest.mark.parametrize("n", [1, 15, 16, 1000, 70000])
def test_round_bf16_rounds_as_torch(n):
    """Nearest even, ties included (the exact halfway values below), and inf, NaN, denormals;
    70000 elements split over threads. The special values lie in the first half only, so that
    vectors with and without them (which AVX512-BF16 builds convert by another path) both occur.
    A NaN, whatever its sign and payload, comes out as 0x7fc0 (torch's own NaN bits differ by
    path: its vector conversion gave 0xffff for the negative one below)."""
    x = rand(n, dtype=torch.float32, seed=n, scale=100.0)
    bits = x.view(torch.int32)
    bits[::3] = (bits[::3] & ~0xFFFF) | 0x8000  # halfway between two bf16 values: ties to even
    first = x[:max(1, n // 2)]
    first[::7] = torch.tensor([float("inf"), -float("inf"), 1e-40, -0.0, 3.0e38, float("nan"), 0.0])[
        torch.arange(len(first[::7])) % 7]
    if n >= 16:
        bits[6] = 0xFFC12345 - (1 << 32)  # a NaN with its sign set and a payload
    got = load().round_bf16(x)
    want = x.to(torch.bfloat16)
    assert torch.equal(got.isnan(), want.isnan())
    assert bool((got[got.isnan()].view(torch.int16) == 0x7FC0).all())
    finite = ~want.isnan()
    assert torch.equal(got[finite].view(torch.int16), want[finite].view(torch.int16))
    with pytest.raises(ValueError, match="x must be a contiguous fp32 CPU tensor"):
        load().round_bf16(x.to(torch.bfloat16))


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
    import structspec.kernels.cpu_layer
    from structspec.engine.runner import make_runner

    model = llama(torch.bfloat16)
    monkeypatch.setenv("CC", "no-such-cc")
    with caplog.at_level(logging.WARNING, logger="structspec.engine.runner"):
        runner = make_runner(model, "auto", lean=True, cache_dir=tmp_path / "empty")
    # no compiler: neither C library builds, and the whole forward stays in torch
    assert runner.attention == "torch" and runner.lean is not None and runner.lean.ops is None
    monkeypatch.delenv("CC")
    real = structspec.kernels.cpu_layer.LayerOps.silu_mul
    monkeypatch.setattr(structspec.kernels.cpu_layer.LayerOps, "silu_mul", lambda self, gu, threads=None: real(self, gu) + 1.0)
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


# vocabularies: SmolLM2's (a multiple of 32), one ending mid-word of the mask, one under a vector
VOCABS = [49152, 1000, 13]


def logits_and_mask(rows: int, vocab: int, dtype, seed: int):
    """Random logits with the hard cases planted, and a random allow-mask with empty and full rows."""
    x = rand(rows, vocab, dtype=dtype, seed=seed, scale=4.0)
    gen = torch.Generator().manual_seed(seed + 1)
    words = (vocab + 31) // 32
    mask = torch.randint(-2**31, 2**31 - 1, (rows, words), generator=gen, dtype=torch.int32)
    mask[0] = 0  # nothing allowed
    mask[1] = -1  # everything allowed, with the maximum tied across vector lanes and words
    x[1, 3] = x[1, vocab - 1] = x[1, vocab // 2] = 99.0
    x[2] = float("-inf")  # allowed tokens, none usable
    mask[3] = -1
    x[3, :] = float("nan")  # NaN is never chosen, not even over -inf
    x[3, vocab - 1] = -1e30
    mask[4, : words // 2] = 0  # the first half masked out, a large logit there
    x[4, 0] = 1e4
    return x, mask


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vocab", VOCABS)
def test_masked_argmax_is_torchs_exactly_and_logz_its_logsumexp(dtype, vocab):
    from structspec.kernels.greedy import masked_argmax_torch
    from structspec.engine.step import masked_rows

    x, mask = logits_and_mask(40, vocab, dtype, seed=vocab)
    ops = load()
    idx, logz = ops.masked_argmax(x, mask, logz=True)
    assert torch.equal(idx, masked_argmax_torch(x, mask))
    assert idx[0] == -1 and idx[1] == 3 and idx[2] == -1 and idx[3] == vocab - 1
    want = torch.logsumexp(masked_rows(x, mask, slice(0, 40)), dim=-1)
    usable = ~want.isnan()  # torch's sum turns NaN on row 3; the kernel leaves NaN logits out
    assert usable.sum() == 39 and torch.isneginf(logz[[0, 2]]).all() and float(logz[3]) == float(x[3, vocab - 1])
    torch.testing.assert_close(logz[usable], want[usable], rtol=2e-6, atol=2e-6)
    # a subset of rows, in any order, of logits with a row stride wider than the vocabulary
    wide = torch.zeros(40, vocab + 7, dtype=dtype)
    wide[:, :vocab] = x
    rows = torch.tensor([5, 1, 39, 5])
    got, none = ops.masked_argmax(wide[:, :vocab], mask, rows)
    assert none is None and torch.equal(got, idx[rows])


def test_masked_argmax_refuses_what_it_cannot_read():
    ops = load()
    x, mask = logits_and_mask(6, 100, torch.float32, seed=0)
    with pytest.raises(ValueError, match="bitmask must be 2-D int32"):
        ops.masked_argmax(x, mask.to(torch.int64))
    with pytest.raises(ValueError, match="does not cover"):
        ops.masked_argmax(x, mask[:, :3])
    with pytest.raises(ValueError, match="rows must be 1-D indices"):
        ops.masked_argmax(x, mask, torch.tensor([6]))
    with pytest.raises(ValueError, match="unit last stride"):
        ops.masked_argmax(x.t(), mask)


def test_the_engine_verifies_greedy_steps_natively_with_the_references_tokens(tiny_normal_loaded, monkeypatch):
    """Greedy verification through the C masked argmax emits what the torch reference emits on
    the same logits (a fixed strategy, so every step is the same in both runs), and the emitted
    tokens' probabilities (the confidence) agree to fp32 rounding."""
    import structspec.engine.engine as engine_module
    from structspec.engine.engine import Engine, Request
    from structspec.options import RequestOptions

    engine = Engine(tiny_normal_loaded, engine_max_seqs=3)  # kernel_backend auto, on a CPU
    assert engine.verification == "native"
    assert Engine(tiny_normal_loaded, kernel_backend="torch").verification == "torch"
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "n": {"type": "integer"}},
              "required": ["name", "n"]}
    docs = ["name: Ada Lovelace, n: 36", "name: Alan Turing, n: 41", "the name is Grace, n is 85",
            "n = 7 and name = Edsger"]
    options = RequestOptions(strategy="ngram", draft_len=4, max_tokens=40)
    real_probs = engine_module.emitted_probs

    def run():
        probs, calls = [], []
        monkeypatch.setattr(engine_module, "emitted_probs", lambda *a: probs.append(real_probs(*a)) or probs[-1])
        if engine.native_verify is not None:
            real = type(engine.native_verify).masked_argmax
            monkeypatch.setattr(type(engine.native_verify), "masked_argmax",
                                lambda *a, **k: calls.append(1) or real(*a, **k))
        engine.clear_prefix_cache()
        results = engine.run([Request(schema, d, options) for d in docs])
        monkeypatch.undo()
        return results, probs, calls

    native, native_probs, calls = run()
    assert calls, "the native masked argmax did not run"
    engine.native_verify = None
    reference, reference_probs, _ = run()
    assert [r.text for r in native] == [r.text for r in reference]
    assert sum(r.stats.output_tokens for r in native) > 4 * 20
    assert len(native_probs) == len(reference_probs) and any(native_probs)
    for got, want in zip(native_probs, reference_probs):
        assert got == [pytest.approx(w, rel=1e-5, abs=1e-7) for w in want]
