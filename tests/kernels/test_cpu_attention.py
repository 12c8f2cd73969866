"""The native CPU attention (kernels/cpu_attention.c) against the torch reference, the engine's
choice of it and its fallback."""

from __future__ import annotations

import logging

import pytest
import torch
from kernel_cases import CPU_FLAGS, CPU_VENDOR, DEVICE

from structspec.kernels import native
from structspec.kernels.attention import attention_reference
from structspec.kernels.cpu_attention import FLAGS, SOURCE, NativeAttention, load

pytestmark = pytest.mark.skipif(DEVICE.type == "cuda", reason="a CPU kernel: the GPU kit runs the CUDA ones")
# (rows, past): decode rows, verification rows, a long context (several key blocks of 64)
# (150, 20) and (70, 0): prefill chunks, which the kernel splits into items of 64 rows (ROW_BLOCK)
SEQUENCES = [(1, 7), (4, 30), (1, 0), (3, 200), (8, 63), (1, 130), (150, 20), (70, 0)]


def p_dtype(lib, kv_dtype):
    """The reference's rounding of P for `lib`'s P.V: bf16 over bf16 KV where the CPU has AVX512-BF16
    (cpu_attention.c's pv_bf16), none elsewhere."""
    return torch.bfloat16 if lib.p_bf16 and kv_dtype == torch.bfloat16 else None


def assert_matches_reference(out, reference, rounding, value_buffers):
    """`out` against `reference(p_dtype)`, an attention_reference call.
    With no rounding of P: within 2e-5 (fp32 reassociation). With P rounded to bf16: within the
    rounding's bound of the exact reference (each probability moves by at most 2^-9 of itself, so
    an output by at most 2^-9 of the largest value it weighs), and equal to the rounded one up to
    fp32 reassociation except where a probability lay within that reassociation of a bf16 rounding
    boundary (a few outputs)."""
    exact = reference(None)
    if rounding is None:
        assert (out - exact).abs().max().item() <= 2e-5
        return
    rounded = reference(rounding)
    largest = max(b.float().abs().max().item() for b in value_buffers)
    assert (out - exact).abs().max().item() <= 2e-5 + 2 ** -9 * largest
    close = (out - rounded).abs() <= 2e-5
    assert close.float().mean().item() >= 0.99, f"{(~close).sum().item()} of {close.numel()} outputs part"
    assert not torch.equal(exact, rounded)  # the rounding is one the exact reference lacks


def case(dtype, kv_dtype, heads, kv_heads, dim, dim_v, layers=3, seed=0):
    gen = torch.Generator().manual_seed(seed)
    rows = [r for r, _ in SEQUENCES]
    pasts = [p for _, p in SEQUENCES]
    starts = [sum(rows[:i]) for i in range(len(rows))]
    caps = [p + r + 5 for r, p in SEQUENCES]

    def rand(*shape, dt=dtype):
        return torch.randn(*shape, generator=gen).to(dt)

    keys = [[rand(kv_heads, c, dim, dt=kv_dtype) for c in caps] for _ in range(layers)]
    values = [[rand(kv_heads, c, dim_v, dt=kv_dtype) for c in caps] for _ in range(layers)]
    table = torch.tensor([[b.data_ptr() for b in keys[i]] for i in range(layers)]
                         + [[b.data_ptr() for b in values[i]] for i in range(layers)]
                         + [starts, rows, pasts, caps], dtype=torch.int64)
    q, k, v = rand(sum(rows), heads, dim), rand(sum(rows), kv_heads, dim), rand(sum(rows), kv_heads, dim_v)
    return q, k, v, keys, values, table, starts, rows, pasts


@pytest.mark.parametrize("dtype, kv_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.float32),
                                             (torch.bfloat16, torch.bfloat16)])
# SmolLM2's 9 heads over 3 kv heads, Qwen2.5's 14 over 2, plain multi-head, value sizes of their own
# (80: a bf16 P.V whose last 16 dims are not a whole 32)
@pytest.mark.parametrize("heads, kv_heads, dim, dim_v", [(9, 3, 64, 64), (14, 2, 64, 64), (4, 4, 32, 32),
                                                         (6, 2, 16, 40), (8, 2, 64, 80)])
@pytest.mark.parametrize("window", [None, 6, 100])
def test_native_attention_matches_the_reference_and_writes_only_the_new_rows(dtype, kv_dtype, heads, kv_heads, dim,
                                                                             dim_v, window):
    q, k, v, keys, values, table, starts, rows, pasts = case(dtype, kv_dtype, heads, kv_heads, dim, dim_v)
    layer = 1
    ref_k = [b.float() for b in keys[layer]]
    ref_v = [b.float() for b in values[layer]]
    others = [b.clone() for b in keys[0] + keys[2] + values[0] + values[2]]
    out = torch.full((q.shape[0], heads, dim_v), float("nan"))
    lib = load(dim, dim_v)
    lib.attend(q, k, v, out, table, 3, layer, dim ** -0.5, window, kv_dtype)
    # fp32 arithmetic on the same (rounded) inputs: fp32 reassociation is the only difference
    # (the reference writes the new rows into ref_k, ref_v: the same rows each call)
    assert_matches_reference(out, lambda rounding: attention_reference(
        q.float(), k.float(), v.float(), ref_k, ref_v, starts, rows, pasts, window=window, p_dtype=rounding),
        p_dtype(lib, kv_dtype), ref_v)
    # the new rows landed at [past, past + rows) of this layer's buffers, exactly; nothing else moved
    for got, expected in zip(keys[layer] + values[layer], ref_k + ref_v):
        assert torch.equal(got.float(), expected)
    assert all(torch.equal(a, b) for a, b in zip(keys[0] + keys[2] + values[0] + values[2], others))


def test_native_attention_honours_strides_scale_and_thread_counts():
    q, k, v, keys, values, table, starts, rows, pasts = case(torch.float32, torch.float32, 9, 3, 64, 64)
    strided = q.transpose(0, 1).contiguous().transpose(0, 1)  # [heads, T, dim] viewed as [T, heads, dim]
    assert not strided.is_contiguous()
    before = [b.clone() for b in keys[0] + values[0]]
    lib = load(64, 64)
    outs = []
    for threads in (1, 2):
        for b, saved in zip(keys[0] + values[0], before):
            b.copy_(saved)
        out = torch.empty(q.shape[0], 9, 64)
        lib.attend(strided, k, v, out, table, 3, 0, 0.3, threads=threads)
        outs.append(out)
    n = len(SEQUENCES)
    want = attention_reference(q, k, v, [b.clone() for b in before[:n]], [b.clone() for b in before[n:]], starts, rows,
                               pasts, scale=0.3)
    assert (outs[0] - want).abs().max().item() <= 2e-5
    assert torch.equal(outs[0], outs[1])  # work items are independent: the thread count changes nothing


# Builds of the kernel other than this CPU's own (-march=native plus these flags), that run here:
# what other hosts compile; (flags, why it is not run here or None). The same source once broke
# the bit agreement below on a Zen 4 only, where GCC's AMD tuning left a product unfused that
# Intel's tuning fused.
OTHER_BUILDS = {
    "other vendor's tuning": (("-mtune=skylake-avx512",) if CPU_VENDOR == "AuthenticAMD" else ("-mtune=znver3",),
                              None),
    "AVX2 build": (("-mno-avx512f",),
                   None if "avx512f" in CPU_FLAGS else "this CPU has no AVX-512: its own build is the AVX2 one"),
    "AVX-512 without bf16": (("-mno-avx512bf16",),
                             None if "avx512_bf16" in CPU_FLAGS else "this CPU has no AVX512-BF16: its own build is it"),
}


@pytest.fixture(scope="module")
def builds(tmp_path_factory):
    """{name: library}: this CPU's own (`load`) and OTHER_BUILDS, built once per module."""
    cache = tmp_path_factory.mktemp("attention-builds")
    made = {}

    def get(name):
        if name not in made:
            if name == "native":
                made[name] = load(64, 64)
            else:
                flags, why_not = OTHER_BUILDS[name]
                if why_not is not None:
                    pytest.skip(why_not)
                path = native.build(SOURCE, FLAGS + ("-DHEAD_DIM=64", "-DVALUE_DIM=64") + flags, cache)
                made[name] = NativeAttention(path, 64, 64)
        return made[name]

    return get


@pytest.mark.parametrize("build", ["native", *OTHER_BUILDS])
@pytest.mark.parametrize("dtype, kv_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16)])
@pytest.mark.parametrize("heads, kv_heads", [(9, 3), (14, 2)])
def test_a_rows_result_does_not_depend_on_the_rows_beside_it(dtype, kv_dtype, heads, kv_heads, build, builds):
    """A 70-row chunk (items of 64 and 6 rows), then each of its rows again in pieces of 1, 2 and
    5 rows over the same keys: every row's output is the same bits however it was grouped. On a
    CPU with AVX512-BF16 the bf16 q.K puts queries in the lanes for big items and keys for small
    ones (cpu_attention.c: qk_queries, qk_keys); both must give a score the same bits, or a
    sequence's prefill and decoding would depend on its batch. Also for the builds other CPUs
    get that run on this one (OTHER_BUILDS)."""
    gen = torch.Generator().manual_seed(3)
    past, total, dim = 37, 70, 64
    cap = past + total + 4
    key_buf = torch.randn(kv_heads, cap, dim, generator=gen).to(kv_dtype)
    value_buf = torch.randn(kv_heads, cap, dim, generator=gen).to(kv_dtype)
    q = torch.randn(total, heads, dim, generator=gen).to(dtype)
    k = torch.randn(total, kv_heads, dim, generator=gen).to(dtype)
    v = torch.randn(total, kv_heads, dim, generator=gen).to(dtype)
    lib = builds(build)

    def attend(first: int, rows: int) -> torch.Tensor:
        table = torch.tensor([[key_buf.data_ptr()], [value_buf.data_ptr()], [0], [rows], [past + first], [cap]],
                             dtype=torch.int64)
        out = torch.empty(rows, heads, dim)
        lib.attend(q[first:first + rows], k[first:first + rows], v[first:first + rows], out, table, 1, 0, 0.125,
                   kv_dtype=kv_dtype)
        return out

    whole = attend(0, total)
    for piece in (1, 2, 5):
        parts = torch.cat([attend(first, min(piece, total - first)) for first in range(0, total, piece)])
        assert torch.equal(parts, whole), piece


@pytest.mark.parametrize("dtype, kv_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16)])
@pytest.mark.parametrize("window", [None, 100])
def test_a_shared_prefix_is_read_from_its_entry_with_the_same_results(dtype, kv_dtype, window):
    """With the shared-prefix rows, blocks inside a sequence's prefix are read from the entry: an
    entry holding the same bits gives bit-identical outputs; an entry holding other values
    changes exactly the sequences that name it, as the reference over those values says."""
    q, k, v, keys, values, table, starts, rows, pasts = case(dtype, kv_dtype, 9, 3, 64, 64)
    layers, lib = 3, load(64, 64)
    # sequences 3 (200 past) and 5 (130 past) share a 130-token prefix: sequence 5's copy is the entry's
    length = 130
    for layer in range(layers):
        for buffers in (keys, values):
            buffers[layer][3][:, :length] = buffers[layer][5][:, :length]
    entry_k = [keys[i][5][:, :length].clone() for i in range(layers)]
    entry_v = [values[i][5][:, :length].clone() for i in range(layers)]
    saved = [b.clone() for b in keys[1] + values[1]]

    def run(entry_keys, entry_values):
        for b, s in zip(keys[1] + values[1], saved):
            b.copy_(s)
        n = table.shape[1]
        ptrs = [[0] * n for _ in range(2 * layers)]
        for j in (3, 5):
            for i in range(layers):
                ptrs[i][j], ptrs[layers + i][j] = entry_keys[i].data_ptr(), entry_values[i].data_ptr()
        lengths = [length if j in (3, 5) else 0 for j in range(n)]
        shared = torch.cat([table, torch.tensor(ptrs + [lengths, lengths], dtype=torch.int64)]).contiguous()
        out = torch.empty(q.shape[0], 9, 64)
        lib.attend(q, k, v, out, shared, layers, 1, 0.125, window, kv_dtype)
        return out

    plain = torch.empty(q.shape[0], 9, 64)
    lib.attend(q, k, v, plain, table, layers, 1, 0.125, window, kv_dtype)
    assert torch.equal(run(entry_k, entry_v), plain)
    if window is not None:  # which blocks lie inside the prefix then depends on the window's start
        return
    # an entry of other values: sequences 3 and 5 now attend over them in their first 128 keys
    # (the blocks of 64 wholly inside the prefix) and over their own copies past that
    other_k = [t + 1.0 for t in entry_k]
    other_v = [t * 2.0 for t in entry_v]
    got = run(other_k, other_v)
    ref_k = [b.clone() for b in keys[1]]
    ref_v = [b.clone() for b in values[1]]
    for j in (3, 5):
        ref_k[j][:, :128] = other_k[1][:, :128]
        ref_v[j][:, :128] = other_v[1][:, :128]
    assert_matches_reference(got, lambda rounding: attention_reference(
        q.float(), k.float(), v.float(), [b.float() for b in ref_k], [b.float() for b in ref_v], starts, rows, pasts,
        scale=0.125, window=window, p_dtype=rounding), p_dtype(lib, kv_dtype), ref_v)
    changed = [starts[j] + i for j in (3, 5) for i in range(rows[j])]
    same = [t for t in range(q.shape[0]) if t not in changed]
    assert torch.equal(got[same], plain[same]) and not torch.equal(got[changed], plain[changed])


def test_bf16_q_k_runs_on_the_matrix_units_where_the_cpu_has_them_with_the_same_results_on_any_threads():
    """On a CPU with AMX (and AVX512-BF16) the bf16 path's q.K runs on the tiles: each thread
    configures them for the call (oneDNN's GEMMs on the same threads configure their own), so
    1 and 2 threads, and rows of up to 16 or more queries an item, agree with the reference."""
    lib = load(64, 64)
    if {"amx_bf16", "avx512_bf16"} <= CPU_FLAGS:
        assert lib.amx, "this CPU has AMX but the attention does not use it (did the OS refuse the tiles?)"
    else:
        assert not lib.amx
    q, k, v, keys, values, table, starts, rows, pasts = case(torch.bfloat16, torch.bfloat16, 9, 3, 64, 64)
    before = [b.clone() for b in keys[2] + values[2]]
    outs = []
    for threads in (1, 2):
        for b, saved in zip(keys[2] + values[2], before):
            b.copy_(saved)
        out = torch.empty(q.shape[0], 9, 64)
        lib.attend(q, k, v, out, table, 3, 2, 0.125, kv_dtype=torch.bfloat16, threads=threads)
        outs.append(out)
    # rows of 8 over 3 heads: 24 queries, two tiles
    assert_matches_reference(outs[0], lambda rounding: attention_reference(
        q.float(), k.float(), v.float(), [b.float() for b in keys[2]], [b.float() for b in values[2]], starts, rows,
        pasts, scale=0.125, p_dtype=rounding), p_dtype(lib, torch.bfloat16), values[2])
    assert torch.equal(outs[0], outs[1])


def test_bad_arguments_are_named():
    q, k, v, keys, values, table, *_ = case(torch.float32, torch.float32, 9, 3, 64, 64)
    lib = load(64, 64)
    out = torch.empty(q.shape[0], 9, 64)
    with pytest.raises(ValueError, match="share fp32 or bf16"):
        lib.attend(q.half(), k.half(), v.half(), out, table, 3, 0, 0.125)
    with pytest.raises(ValueError, match="built for 64/64"):
        lib.attend(q[..., :32], k[..., :32], v, out, table, 3, 0, 0.125)
    with pytest.raises(ValueError, match="KV buffers of torch.bfloat16 take torch.bfloat16 rows"):
        lib.attend(q, k, v, out, table, 3, 0, 0.125, kv_dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="table must be"):
        lib.attend(q, k, v, out, table[:5], 3, 0, 0.125)
    with pytest.raises(ValueError, match="out must be"):
        lib.attend(q, k, v, out.bfloat16(), table, 3, 0, 0.125)
    with pytest.raises(ValueError, match="table must be"):  # check=False is for callers that checked before
        lib.attend(q, k, v, out, table[:5], 3, 0, 0.125, check=True)


def test_no_compiler_is_a_clear_error(monkeypatch, tmp_path):
    monkeypatch.setenv("CC", "no-such-cc")
    with pytest.raises(RuntimeError, match="no C compiler \\('no-such-cc' not found; set CC\\)"):
        load(24, 24, tmp_path)


def test_the_engine_picks_the_native_attention_on_a_cpu_and_falls_back_when_it_fails(tiny_normal_loaded,
                                                                                    monkeypatch, caplog, tmp_path):
    import structspec.kernels.cpu_attention
    from structspec.engine.runner import make_runner

    runner = make_runner(tiny_normal_loaded.model, "auto", cache_dir=tmp_path)
    assert runner.batched and runner.attention == "native" and runner.native is not None
    assert list(tmp_path.glob("cpu_attention_*.so"))  # built where the engine was told

    def broken(self, *args, **kwargs):
        raise RuntimeError("no kernel today")

    monkeypatch.setattr(structspec.kernels.cpu_attention.NativeAttention, "attend", broken)
    with caplog.at_level(logging.WARNING, logger="structspec.engine.runner"):
        runner = make_runner(tiny_normal_loaded.model, "auto", cache_dir=tmp_path)
    assert runner.batched and runner.attention == "torch"
    assert "the native attention failed its check (no kernel today); using the torch attention" in caplog.text
    assert make_runner(tiny_normal_loaded.model, "torch").attention == "torch"
