"""The native linear kernel (kernels/cpu_linear.c), bf16 and fp32, against an exact reference,
its row independence, its argument checks, and the engine's choice of it (engine/packed.py)."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
import torch.nn.functional as F
from kernel_cases import CPU_FLAGS, DEVICE, pack_bitmask

from structspec.kernels.cpu_linear import load

pytestmark = pytest.mark.skipif(DEVICE.type == "cuda", reason="a CPU kernel: the GPU kit runs the CUDA ones")


FLAGS = CPU_FLAGS
HAS_KERNEL = "avx512f" in FLAGS or {"avx2", "fma"} <= FLAGS  # the fp32 kernel: AVX-512F, or AVX2 with FMA
HAS_DPBF16 = "avx512_bf16" in FLAGS
# the engine picks the kernel for bf16 on CPUs with AVX512-BF16 (on the AMX tiles where the CPU
# has them), and for fp32 on CPUs with no bf16 units at all (engine/packed.py)
ENGINE_PICKS_IT = HAS_DPBF16
HAS_AMX = HAS_DPBF16 and {"amx_tile", "amx_bf16"} <= FLAGS
ENGINE_PICKS_F32 = HAS_KERNEL and not HAS_DPBF16 and "amx_tile" not in FLAGS
needs_dpbf16 = pytest.mark.skipif(not HAS_DPBF16, reason="this CPU lacks AVX512-BF16, which the bf16 kernel needs "
                                  "(test_the_kernel_builds_where_... checks the refusal)")
needs_kernel = pytest.mark.skipif(not HAS_KERNEL, reason="this CPU lacks both AVX-512F and AVX2 with FMA, one of "
                                  "which the kernel needs (test_the_kernel_builds_where_... checks the refusal)")


@pytest.fixture(scope="module")
def lib(tmp_path_factory):
    return load(tmp_path_factory.mktemp("kernels"))


def rand(*shape, seed, scale=1.0, dtype=torch.bfloat16):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=gen) * scale).to(dtype)


# (rows, in, out): decode and verification rows, a row count that splits into uneven tiles, a
# prefill-sized one (split over threads), out widths off the 48-column group and the 16-lane vector
SHAPES = [(1, 576, 960), (3, 64, 40), (16, 576, 3072), (13, 1536, 576), (9, 18, 7), (70, 128, 100), (300, 576, 200)]


@needs_dpbf16
@pytest.mark.parametrize("m, k, n", SHAPES)
@pytest.mark.parametrize("with_bias", [False, True])
def test_each_output_is_the_exact_sum_rounded_once_to_bf16_within_fp32_accumulation(m, k, n, with_bias, lib):
    w, x = rand(n, k, seed=1, scale=0.05), rand(m, k, seed=2)
    bias = rand(n, seed=3, dtype=torch.float32) if with_bias else None
    got = lib.linear(x, lib.pack(w, bias))
    exact = x.double() @ w.double().T + (0 if bias is None else bias.double())
    # fp32 accumulation over k products: |error| <= k * 2^-24 * sum|products|; then one bf16 rounding
    scale = (x.double().abs() @ w.double().abs().T) + (0 if bias is None else bias.double().abs())
    allowed = exact.abs() * 2.0 ** -8 + k * 2.0 ** -24 * scale * 1.01
    assert got.dtype == torch.bfloat16 and got.shape == (m, n)
    assert bool(((got.double() - exact).abs() <= allowed).all())
    # against F.linear (another summation order): mostly the same bits, never more than a bf16 unit apart
    want = F.linear(x, w, None if bias is None else bias.to(torch.bfloat16))
    if bias is None:
        assert (got == want).float().mean() > 0.95


@needs_kernel
@pytest.mark.parametrize("m, k, n", SHAPES)
@pytest.mark.parametrize("with_bias", [False, True])
def test_each_fp32_output_is_the_exact_sum_within_fp32_accumulation(m, k, n, with_bias, lib):
    w, x = rand(n, k, seed=1, scale=0.05, dtype=torch.float32), rand(m, k, seed=2, dtype=torch.float32)
    bias = rand(n, seed=3, dtype=torch.float32) if with_bias else None
    got = lib.linear(x, lib.pack(w, bias))
    exact = x.double() @ w.double().T + (0 if bias is None else bias.double())
    # fp32 accumulation over k products and the bias: |error| <= (k + 1) * 2^-24 * sum of |terms|
    scale = (x.double().abs() @ w.double().abs().T) + (0 if bias is None else bias.double().abs())
    assert got.dtype == torch.float32 and got.shape == (m, n)
    assert bool(((got.double() - exact).abs() <= (k + 1) * 2.0 ** -24 * scale * 1.01).all())
    assert torch.allclose(got, F.linear(x, w, bias), rtol=1e-4, atol=1e-4)  # F.linear: another order


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, pytest.param(torch.bfloat16, marks=needs_dpbf16)])
def test_a_rows_result_does_not_depend_on_the_rows_beside_it(lib, dtype):
    """Every output is one chain over k in order, so a row computed among 1, 2, ..., 40 rows
    (tiles of every size, the row at every place in its tile) has the same bits."""
    w = rand(200, 576, seed=4, scale=0.05, dtype=dtype)
    packed = lib.pack(w)
    x = rand(40, 576, seed=5, dtype=dtype)
    alone = torch.cat([lib.linear(x[i:i + 1], packed) for i in range(40)])
    for m in (2, 5, 8, 9, 12, 16, 17, 40):
        for start in range(0, 40, m):
            assert torch.equal(lib.linear(x[start:start + m], packed), alone[start:start + m]), (m, start)
    assert torch.equal(lib.linear(x, packed, threads=1), alone)  # and the thread count changes nothing


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, pytest.param(torch.bfloat16, marks=needs_dpbf16)])
def test_strided_rows_and_leading_dimensions(lib, dtype):
    w = rand(96, 64, seed=6, dtype=dtype)
    packed = lib.pack(w)
    wide = rand(12, 100, seed=7, dtype=dtype)
    view = wide[:, 10:74]  # rows with a stride of 100 elements
    for m in (5, 12):  # few rows, and more than fp32 reads from their own stride
        assert torch.equal(lib.linear(view[:m], packed), lib.linear(view[:m].contiguous(), packed))
    x3 = rand(2, 3, 64, seed=8, dtype=dtype)
    assert torch.equal(lib.linear(x3, packed), lib.linear(x3.reshape(6, 64), packed).view(2, 3, 96))
    assert lib.linear(rand(0, 64, seed=9, dtype=dtype), packed).shape == (0, 96)
    w_view = rand(96, 80, seed=10, dtype=dtype)[:, :64]  # a weight with a row stride past its width
    assert torch.equal(lib.linear(view, lib.pack(w_view)), lib.linear(view, lib.pack(w_view.contiguous())))


@needs_kernel
def test_bad_arguments_are_refused_saying_what_is_wrong(lib):
    served = "bfloat16 or float32" if HAS_DPBF16 else "float32"
    with pytest.raises(ValueError, match=f"2-D {served} CPU tensor, got torch.float16"):
        lib.pack(rand(8, 8, seed=1, dtype=torch.float16))
    with pytest.raises(ValueError, match=r"bias must have shape \(8,\)"):
        lib.pack(rand(8, 8, seed=1, dtype=torch.float32), torch.zeros(9))
    packed = lib.pack(rand(8, 8, seed=1, dtype=torch.float32))
    with pytest.raises(ValueError, match="last dimension 8"):
        lib.linear(rand(2, 6, seed=2, dtype=torch.float32), packed)
    with pytest.raises(ValueError, match="must be float32"):
        lib.linear(rand(2, 8, seed=2, dtype=torch.float16), packed)
    if HAS_DPBF16:
        with pytest.raises(ValueError, match="in_features must be even"):
            lib.pack(rand(8, 7, seed=1))
        with pytest.raises(ValueError, match="must be bfloat16"):
            lib.linear(rand(2, 8, seed=2, dtype=torch.float32), lib.pack(rand(8, 8, seed=1)))
    else:
        with pytest.raises(RuntimeError, match="no bf16"):
            lib.entry_point()


PRUNED_DTYPES = [torch.float32, pytest.param(torch.bfloat16, marks=needs_dpbf16)]


@needs_kernel
@pytest.mark.parametrize("dtype", PRUNED_DTYPES)
@pytest.mark.parametrize("m, k, n", [(1, 576, 960), (7, 64, 1003), (20, 40, 77), (32, 96, 4096)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_pruned_outputs_are_the_full_products_bits_where_asked_and_minus_inf_elsewhere(m, k, n, with_bias, dtype, lib):
    """linear_pruned: the rows marked dense get every column, the others the wanted 16-column
    groups (a last group cut short by n included), and in bf16 the rest of the kernel's 48-column
    groups holding them; each of those is linear's value bit for bit (the same chain over k,
    whether its group took every row or only the dense ones, in tiles of any size, on 1 or 2
    threads); every other output is -inf."""
    from structspec.kernels.cpu_linear import GROUP_COLUMNS

    w, x = rand(n, k, seed=11, scale=0.05, dtype=dtype), rand(m, k, seed=12, dtype=dtype)
    packed = lib.pack(w, rand(n, seed=13, dtype=torch.float32) if with_bias else None)
    full = lib.linear(x, packed)
    groups = -(-n // GROUP_COLUMNS)
    per = lib.group_columns(dtype) // GROUP_COLUMNS  # wanted groups a computed group (bf16: 3, fp32: 1)
    gen = torch.Generator().manual_seed(m + n)
    cases = [(torch.rand(m, generator=gen) < 0.4, torch.rand(groups, generator=gen) < 0.3),
             (torch.ones(m, dtype=torch.bool), torch.zeros(groups, dtype=torch.bool)),
             (torch.zeros(m, dtype=torch.bool), torch.zeros(groups, dtype=torch.bool)),
             (torch.zeros(m, dtype=torch.bool), torch.arange(groups) == groups - 1)]
    for dense, wanted in cases:
        padded = torch.cat([wanted, wanted.new_zeros(-groups % per)]).view(-1, per).any(1)  # whole computed groups
        asked = dense.unsqueeze(1) | padded.repeat_interleave(per * GROUP_COLUMNS)[:n].unsqueeze(0)
        assert bool(asked[~dense][:, wanted.repeat_interleave(GROUP_COLUMNS)[:n]].all())  # covers what was asked
        for threads in (1, 2):
            got = lib.linear_pruned(x, packed, dense, wanted, threads=threads)
            assert got.shape == (m, n) and got.dtype == dtype
            assert torch.equal(got[asked], full[asked]), (dense, wanted, threads)
            assert bool(torch.isneginf(got[~asked]).all())


@needs_kernel
def test_pruned_bad_arguments_are_refused_saying_what_is_wrong(lib):
    packed = lib.pack(rand(40, 8, seed=1, dtype=torch.float32))  # 3 groups of 16 columns
    x, dense, wanted = rand(2, 8, seed=2, dtype=torch.float32), torch.ones(2, dtype=torch.bool), torch.ones(3, dtype=torch.bool)
    assert torch.equal(lib.linear_pruned(x, packed, dense, wanted), lib.linear(x, packed))
    with pytest.raises(ValueError, match=r"wanted must be bool \[3\] \(groups of 16 columns\)"):
        lib.linear_pruned(x, packed, dense, torch.ones(2, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"dense must be bool \[2\]"):
        lib.linear_pruned(x, packed, torch.ones(2, dtype=torch.int32), wanted)
    with pytest.raises(ValueError, match=r"x must be float32 \[m, 8\]"):
        lib.linear_pruned(rand(2, 3, 8, seed=2, dtype=torch.float32), packed, dense, wanted)
    if HAS_DPBF16:
        with pytest.raises(ValueError, match=r"x must be bfloat16 \[m, 8\]"):
            lib.linear_pruned(x, lib.pack(rand(40, 8, seed=1)), dense, wanted)


@needs_kernel
@pytest.mark.parametrize("dtype", PRUNED_DTYPES)
def test_a_pruned_lm_head_gives_every_allowed_logit_the_full_heads_bits(lib, dtype):
    """PackedLinear.forward_allowed on the native kernel (fp32 and bf16): a row allowing a few
    tokens gets those (and the rest of their groups and of the other pruned rows' groups) exactly
    as forward gives them and -inf for tokens no pruned row allows; a row allowing most of the
    vocabulary is computed whole; a layer on oneDNN ignores the mask."""
    from torch import nn

    from structspec.engine.packed import PackedLinear

    vocab, k = 2000, 64  # 125 groups: a row of at most 15 groups is pruned
    head = nn.Linear(k, vocab, bias=False)
    with torch.no_grad():
        head.to(dtype).weight.copy_(rand(vocab, k, seed=21, scale=0.1, dtype=dtype))
    layer = PackedLinear(head, lib)
    x = rand(4, k, seed=22, dtype=dtype)
    rows = [[5, 31, 32, 1999], list(range(0, vocab, 3)), [700], [13, 14, 15]]
    wanted = torch.zeros(len(rows), vocab, dtype=torch.bool)
    for r, tokens in enumerate(rows):
        wanted[r, tokens] = True
    allowed = pack_bitmask(wanted)
    full = layer(x)
    got = layer.forward_allowed(x, allowed)
    for r, tokens in enumerate(rows):
        assert torch.equal(got[r, tokens], full[r, tokens]), r
    assert torch.equal(got[1], full[1])  # most groups allowed: dense
    assert bool(torch.isneginf(got[0, 100:600]).all()) and bool(torch.isneginf(got[2, 1000:1900]).all())
    assert torch.equal(got[0, 0:48], full[0, 0:48])  # groups 0-2 are wanted by rows 0 and 3
    with pytest.raises(ValueError, match=r"allowed must be int32 \[4, words\]"):
        layer.forward_allowed(x, allowed[:3])
    onednn = PackedLinear(head)  # no native library: the mask is ignored
    assert torch.equal(onednn.forward_allowed(x, allowed), onednn(x))


@needs_kernel
@pytest.mark.parametrize("dtype", PRUNED_DTYPES)
def test_an_engine_with_pruned_logits_emits_the_same_tokens_as_one_without(tiny_normal_loaded, monkeypatch,
                                                                          shared_cache, lib, dtype):
    """engine_pruned_logits (the default) against off, on the native kernel in fp32 (picked here
    whatever the CPU's bf16 units) and in bf16: the same tokens for every request, while the
    pruned lm_head really ran on most decoding steps."""
    import structspec.engine.engine as engine_module
    from bench.exactness import bounded
    from structspec.engine.engine import Engine, Request
    from structspec.options import RequestOptions
    from tests.conftest import deepjsoneval_rows

    monkeypatch.setattr(engine_module, "native_linear", lambda *args: lib)
    calls = []
    real = type(lib).linear_pruned
    monkeypatch.setattr(type(lib), "linear_pruned", lambda self, *a, **kw: calls.append(1) or real(self, *a, **kw))
    requests = [Request(bounded(row["schema"]), row["text"],
                        RequestOptions(strategy=("none", "composite")[i % 2], draft_len=4, max_tokens=60,
                                       verbatim=True), trace=True)
                for i, row in enumerate(deepjsoneval_rows(6))]
    loaded = tiny_normal_loaded if dtype == torch.float32 else bf16_loaded(tiny_normal_loaded)
    pruned = Engine(loaded, engine_max_seqs=4, cache_dir=shared_cache)
    assert pruned.linear == "native" and pruned.pruned_logits
    got = pruned.run(requests)
    steps = pruned.metrics.steps
    dense = Engine(loaded, engine_max_seqs=4, cache_dir=shared_cache, engine_pruned_logits=False)
    n_calls = len(calls)
    want = dense.run(requests)
    assert len(calls) == n_calls  # off: never pruned
    assert [r.tokens for r in got] == [r.tokens for r in want]
    assert sum(len(r.tokens) for r in got) > 6 * 20  # the runs did real work
    assert n_calls > steps // 3, (n_calls, steps)  # pruned on a good share of the steps


def test_the_kernel_builds_where_the_cpu_has_avx512f_or_avx2_with_bf16_where_it_has_avx512_bf16(tmp_path):
    if HAS_KERNEL:
        lib = load(tmp_path)
        assert lib.path.parent == tmp_path
        assert lib.dtypes == ({torch.float32, torch.bfloat16} if HAS_DPBF16 else {torch.float32})
    else:
        with pytest.raises(RuntimeError, match="needs AVX-512F, or AVX2 with FMA"):
            load(tmp_path)


def bf16_loaded(tiny_normal_loaded):
    from structspec.engine.model import from_model

    return from_model(copy.deepcopy(tiny_normal_loaded.model).to(torch.bfloat16), tiny_normal_loaded.tokenizer,
                      name="tiny bf16")


def test_the_engine_runs_bf16_linear_layers_natively_where_the_cpu_suits_it(tiny_normal_loaded, tmp_path):
    """kernel_backend auto, bf16, a CPU with AVX512-BF16 (AMX or not): every packed layer (the lean
    forward's fused ones and the model's own, lm_head among them) runs the kernel; elsewhere, and
    under kernel_backend "torch", oneDNN's packing."""
    from structspec.engine.engine import Engine
    from structspec.engine.packed import PackedLinear, bf16_unpackable

    # oneDNN packs bf16 only on CPUs with AVX512 (an AVX2-only one keeps F.linear: "torch")
    onednn_bf16 = "onednn" if bf16_unpackable() is None else "torch"
    engine = Engine(bf16_loaded(tiny_normal_loaded), cache_dir=tmp_path)
    assert engine.linear == ("native" if ENGINE_PICKS_IT else onednn_bf16)
    if ENGINE_PICKS_IT:
        assert isinstance(engine.loaded.model.lm_head, PackedLinear) and engine.loaded.model.lm_head.uses_native()
        assert list((tmp_path / "kernels").glob("cpu_linear_*.so"))  # built where the engine was told
    assert Engine(bf16_loaded(tiny_normal_loaded), kernel_backend="torch").linear == onednn_bf16
    # fp32 weights: the kernel where the CPU has it and no bf16 units, else oneDNN's packing
    assert Engine(tiny_normal_loaded, cache_dir=tmp_path).linear == ("native" if ENGINE_PICKS_F32 else "onednn")
    assert Engine(tiny_normal_loaded, kernel_backend="torch").linear == "onednn"
    assert Engine(bf16_loaded(tiny_normal_loaded), engine_packed_linear=False).linear == "torch"


@pytest.mark.skipif(not ENGINE_PICKS_IT, reason="the engine picks the kernel only on CPUs with AVX512-BF16; "
                    "test_the_engine_runs_bf16_linear_layers_natively_where_the_cpu_suits_it "
                    "checks it keeps oneDNN here")
def test_a_failing_build_keeps_onednn_and_a_repacked_model_follows_the_engine(tiny_normal_loaded, monkeypatch,
                                                                                caplog, tmp_path):
    from structspec.engine.engine import Engine

    loaded = bf16_loaded(tiny_normal_loaded)
    monkeypatch.setenv("CC", "no-such-cc")
    with caplog.at_level(logging.INFO, logger="structspec.engine.packed"):
        engine = Engine(loaded, cache_dir=tmp_path / "empty")
    assert engine.linear == "onednn" and "the native linear kernel is unavailable" in caplog.text
    monkeypatch.delenv("CC")
    # the same model, packed for oneDNN by that engine, is packed anew for the kernel by the next
    assert Engine(loaded, cache_dir=tmp_path).linear == "native"
    assert Engine(loaded, kernel_backend="torch").linear == "onednn"


@pytest.mark.parametrize("dtype", [
    pytest.param(torch.bfloat16, marks=pytest.mark.skipif(not ENGINE_PICKS_IT, reason="the engine picks the bf16 "
                                                          "kernel only on CPUs with AVX512-BF16")),
    pytest.param(torch.float32, marks=pytest.mark.skipif(not ENGINE_PICKS_F32, reason="the engine picks the fp32 "
                                                         "kernel only on CPUs with no bf16 units"))])
def test_native_and_onednn_engines_emit_the_same_tokens_except_at_near_ties(tiny_normal_loaded, monkeypatch,
                                                                           shared_cache, dtype):
    """Both sum in fp32, in different orders: where a run through the kernel parts from the same
    run through oneDNN (everything else equal), the oneDNN run's top-2 allowed logits there were
    within the dtype's near-tie epsilon (tests/unit/engine/test_bf16.py, test_batched.py), and
    most runs never part."""
    import structspec.engine.engine as engine_module
    from bench.exactness import bounded, compare
    from structspec.engine.engine import Engine, Request
    from structspec.options import RequestOptions
    from tests.conftest import deepjsoneval_rows
    from tests.unit.engine.test_batched import EPS
    from tests.unit.engine.test_bf16 import BF16_EPS

    loaded, eps = (bf16_loaded(tiny_normal_loaded), BF16_EPS) if dtype == torch.bfloat16 else (tiny_normal_loaded, EPS)
    requests = [Request(bounded(row["schema"]), row["text"],
                        RequestOptions(strategy=("none", "composite")[i % 2], draft_len=4, max_tokens=80,
                                       verbatim=True), trace=True)
                for i, row in enumerate(deepjsoneval_rows(8))]
    native = Engine(loaded, engine_max_seqs=4, cache_dir=shared_cache)
    assert native.linear == "native"
    got = native.run(requests)
    with monkeypatch.context() as m:
        m.setattr(engine_module, "native_linear", lambda *args: None)
        onednn = Engine(loaded, engine_max_seqs=4, cache_dir=shared_cache)
    assert onednn.linear == "onednn"
    refs = onednn.run(requests)
    diverged = [d for d in (compare(ref, res) for ref, res in zip(refs, got)) if d is not None]
    assert all(d.near_tie(eps) for d in diverged), diverged
    assert len(diverged) <= len(requests) // 2, diverged
    assert sum(len(res.tokens) for res in got) > 8 * 20  # the runs did real work


@needs_dpbf16
def test_a_lean_forward_given_back_leaves_the_models_layers_packed_for_the_kernel(tiny_normal_loaded, lib):
    """When the lean forward fails its start-up check, the model's own layers are packed again
    (LeanForward.release) for the same kernel the lean forward had, not for oneDNN."""
    from structspec.engine.lean import LeanForward
    from structspec.engine.packed import PackedLinear

    model = bf16_loaded(tiny_normal_loaded).model
    lean, why = LeanForward.build(model, True, None, lib)
    assert lean is not None, why
    assert all(m.uses_native() for layer in lean.layers for m in (layer.qkv, layer.o, layer.gate_up, layer.down))
    lean.release()
    packed = [m for m in model.model.layers.modules() if isinstance(m, PackedLinear)]
    assert len(packed) == 7 * len(model.model.layers) and all(m.uses_native() for m in packed)


@needs_dpbf16
def test_bf16_rows_run_on_the_amx_tiles_where_the_cpu_has_them(lib):
    """An AMX CPU's build runs bf16 rows on the tiles (so the bf16 tests above test them there:
    SHAPES has k a multiple of 32, the tiles' steps, and k = 18, the vector loop's), any other
    CPU's on vdpbf16ps; the engine picks the kernel on both (engine/packed.py)."""
    assert lib.amx == HAS_AMX
