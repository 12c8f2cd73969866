"""The ragged attention kernels (kernels/attention.py) against their torch reference, and the
batched engine running on them (in the interpreter) against the one-at-a-time reference."""

from __future__ import annotations

import logging

import pytest
import torch
from kernel_cases import DEVICE

from structspec.kernels.attention import append_kv, attend, attention_reference, step_tables
ENGINE_ON_CPU = pytest.mark.skipif(DEVICE.type == "cuda", reason="the engine tests run the interpreter on the CPU; "
                                   "on a GPU the kit's exactness stage runs the engine")
# (rows, past) per sequence: one-row decode steps, multi-row verification, a first prefill
# chunk (past 0) longer than a query block, contexts longer than a key block
SEQUENCES = [(1, 7), (5, 0), (3, 40), (20, 3), (1, 100), (17, 64)]
TOLERANCE = {torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}
# `make test` checks the kernel without a sliding window here (the CPU kernels' tests check theirs);
# the window in `make test-long` (tests/conftest.py)
LONG_PARAMS = {"test_attend_matches_the_reference_and_writes_only_the_new_rows": {"window": 6}}


def make_case(dtype, heads, kv_heads, dim, dim_v, sequences=SEQUENCES, spare=5, seed=0):
    gen = torch.Generator().manual_seed(seed)
    rows = [r for r, _ in sequences]
    pasts = [p for _, p in sequences]
    starts = [sum(rows[:i]) for i in range(len(rows))]
    total = sum(rows)

    def rand(*shape):
        return torch.randn(*shape, generator=gen).to(dtype).to(DEVICE)

    q, k, v = rand(total, heads, dim), rand(total, kv_heads, dim), rand(total, kv_heads, dim_v)
    k_bufs = [rand(kv_heads, p + r + spare, dim) for r, p in sequences]
    v_bufs = [rand(kv_heads, p + r + spare, dim_v) for r, p in sequences]
    return q, k, v, k_bufs, v_bufs, starts, rows, pasts


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
# SmolLM2's 9 heads over 3 kv heads and Qwen2.5's 14 over 2 among them
@pytest.mark.parametrize("heads, kv_heads, dim, dim_v", [(4, 4, 64, 64), (6, 2, 40, 40), (3, 1, 16, 32),
                                                         (9, 3, 64, 64), (14, 2, 64, 64)])
@pytest.mark.parametrize("window", [None, 6])
def test_attend_matches_the_reference_and_writes_only_the_new_rows(dtype, heads, kv_heads, dim, dim_v, window):
    q, k, v, k_bufs, v_bufs, starts, rows, pasts = make_case(dtype, heads, kv_heads, dim, dim_v)
    ref_k, ref_v = [b.clone() for b in k_bufs], [b.clone() for b in v_bufs]
    k_table, v_table, seg = step_tables(k_bufs, v_bufs, starts, rows, pasts, DEVICE)
    out = attend(q, k, v, k_table, v_table, seg, max(rows), window=window)
    # The reference in fp32 from the same (rounded) inputs: the kernel accumulates in fp32.
    want = attention_reference(q.float(), k.float(), v.float(), [b.float() for b in ref_k],
                               [b.float() for b in ref_v], starts, rows, pasts, window=window)
    assert out.dtype == dtype and out.shape == (q.shape[0], heads, dim_v)
    err = (out.float() - want).abs().max().item()
    assert err <= TOLERANCE[dtype], err
    # the new rows landed at [past, past + rows); the spare room after them is untouched
    attention_reference(q, k, v, ref_k, ref_v, starts, rows, pasts)
    for got, expected in zip(k_bufs + v_bufs, ref_k + ref_v):
        assert torch.equal(got, expected)


def test_scale_and_query_strides_are_honoured():
    q, k, v, k_bufs, v_bufs, starts, rows, pasts = make_case(torch.float32, 4, 2, 32, 32)
    ref_k, ref_v = [b.clone() for b in k_bufs], [b.clone() for b in v_bufs]
    # queries as transformers hands them over: [heads, T, dim] viewed as [T, heads, dim]
    strided = q.transpose(0, 1).contiguous().transpose(0, 1)
    assert not strided.is_contiguous()
    out = attend(strided, k, v, *step_tables(k_bufs, v_bufs, starts, rows, pasts, DEVICE), max(rows), scale=0.3)
    want = attention_reference(q, k, v, ref_k, ref_v, starts, rows, pasts, scale=0.3)
    assert (out - want).abs().max().item() <= TOLERANCE[torch.float32]


def test_append_alone_writes_each_sequences_rows_into_its_own_buffer():
    q, k, v, k_bufs, v_bufs, starts, rows, pasts = make_case(torch.float32, 2, 2, 16, 16)
    append_kv(k, v, *step_tables(k_bufs, v_bufs, starts, rows, pasts, DEVICE))
    for i, (start, n, past) in enumerate(zip(starts, rows, pasts)):
        assert torch.equal(k_bufs[i][:, past:past + n], k[start:start + n].transpose(0, 1))
        assert torch.equal(v_bufs[i][:, past:past + n], v[start:start + n].transpose(0, 1))


def test_bad_tables_and_shapes_are_named():
    q, k, v, k_bufs, v_bufs, starts, rows, pasts = make_case(torch.float32, 4, 2, 16, 16, spare=0)
    with pytest.raises(ValueError, match="sequence 1: 0 \\+ 6 tokens do not fit its buffer of 5"):
        step_tables(k_bufs, v_bufs, starts, [1, 6, 3, 20, 1, 17], pasts, DEVICE)
    with pytest.raises(ValueError, match="one entry per sequence"):
        step_tables(k_bufs, v_bufs[:-1], starts, rows, pasts, DEVICE)
    with pytest.raises(ValueError, match="must be contiguous"):
        step_tables([b.transpose(1, 2).contiguous().transpose(1, 2) for b in k_bufs], v_bufs, starts, rows, pasts,
                    DEVICE)
    with pytest.raises(ValueError, match=f"the KV buffers of sequence 0 are on {DEVICE.type}.*, not meta"):
        step_tables(k_bufs, v_bufs, starts, rows, pasts, torch.device("meta"))
    # a device named without its index ("cuda") is the current one, as the tensors' "cuda:0" says
    tables = step_tables(k_bufs, v_bufs, starts, rows, pasts, torch.device(DEVICE.type))
    with pytest.raises(ValueError, match="not a multiple"):
        attend(q[:, :3], k, v, *tables, max(rows))
    with pytest.raises(ValueError, match="share a dtype"):
        attend(q.half(), k, v, *tables, max(rows))


# --- the engine on the kernels ------------------------------------------------------------------

@ENGINE_ON_CPU
def test_the_triton_runner_gives_the_torch_runners_logits_step_by_step(tiny_normal_loaded):
    """A prefill chunk, a multi-row verification and a one-row step for three sequences at
    once, through both attentions: the same logits within float rounding."""
    from structspec.engine.runner import BatchedRunner, StepInputs, probe
    from structspec.engine.kv_cache import Segment

    model = tiny_normal_loaded.model
    layout = probe(model).layout
    runners = {name: BatchedRunner(model, layout, name) for name in ("torch", "triton")}
    slots = {name: [r.make_slot(64) for _ in range(3)] for name, r in runners.items()}
    gen = torch.Generator().manual_seed(5)
    past = [0, 0, 0]
    for step_rows in ([9, 20, 3], [4, 1, 6], [1, 1, 1]):
        ids = torch.randint(1, 1000, (sum(step_rows),), generator=gen)
        positions = torch.cat([torch.arange(p, p + n) for p, n in zip(past, step_rows)])
        logits = {}
        for name, runner in runners.items():
            segs, start = [], 0
            for slot, n, p in zip(slots[name], step_rows, past):
                segs.append(Segment(slot, start, n, p))
                start += n
            logits[name] = runner.forward(StepInputs(ids, positions, segs, torch.arange(sum(step_rows))))
        scale = logits["torch"].abs().max()
        assert ((logits["triton"] - logits["torch"]).abs().max() / scale).item() < 1e-5
        past = [p + n for p, n in zip(past, step_rows)]


@ENGINE_ON_CPU
def test_the_engine_on_triton_attention_matches_none_one_at_a_time(tiny_normal_loaded, monkeypatch):
    """Greedy outputs of a batch on the Triton attention (interpreted) are those of `none` run
    alone on the torch attention, except where that reference's top-2 masked logits are a
    near-tie (tests/unit/engine/test_batched.py's rule and EPS). In tiles of 64 queries by 256
    keys rather than the kernel's 16 by 64: the interpreter pays per program and per operation,
    not per element, and the tests above check the kernel's own tiles against the reference."""
    import structspec.kernels.attention

    from structspec.engine.engine import Engine, Request
    from tests.conftest import deepjsoneval_rows
    from tests.unit.engine.test_batched import WHITESPACE, References, Tally, options
    from bench.exactness import bounded

    monkeypatch.setattr(structspec.kernels.attention, "BLOCK_M", 64)
    monkeypatch.setattr(structspec.kernels.attention, "BLOCK_N", 256)
    engine = Engine(tiny_normal_loaded, kernel_backend="triton", engine_max_seqs=3, json_whitespace=WHITESPACE)
    assert engine.runner.attention == "triton"
    references = References(tiny_normal_loaded)
    rows = deepjsoneval_rows(4)
    # the documents' first 1,500 characters and 16 tokens: every pass through the interpreted
    # kernel costs seconds (whole documents and 24 tokens took ~4 minutes)
    requests = [Request(bounded(row["schema"]), row["text"][:1500], options(strategy, 6, max_tokens=16))
                for row, strategy in zip(rows, ("none", "composite", "schema", "ngram"))]
    tally = Tally()
    for request, got in zip(requests, engine.run(requests)):
        tally.check(references(request.schema, request.document, request.options), got, request.options.strategy)
    print(f"triton attention, 4 documents: {tally}")
    assert tally.identical + tally.near_tie == 4 and tally.identical >= 2


@ENGINE_ON_CPU
def test_a_triton_attention_that_fails_its_check_falls_back_to_torch(tiny_normal_loaded, monkeypatch, caplog):
    import structspec.kernels.attention
    from structspec.engine.runner import make_runner

    def broken(*args, **kwargs):
        raise RuntimeError("no kernel today")

    monkeypatch.setattr(structspec.kernels.attention, "attend", broken)
    with caplog.at_level(logging.WARNING, logger="structspec.engine.runner"):
        runner = make_runner(tiny_normal_loaded.model, "triton")
    assert runner.batched and runner.attention == "torch"
    assert "the triton attention failed its check (no kernel today); using the torch attention" in caplog.text
    assert make_runner(tiny_normal_loaded.model, "auto").attention == "native"  # auto on a CPU: the C kernel
