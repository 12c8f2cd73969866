"""bf16: the dtype `auto` picks, its start-up check against fp32 (engine/model.py), and the
batched engine against one document at a time with the weights in bf16.

bf16 keeps 8 significant bits, so a batched row and the same row alone (other packing, other
reduction order) differ by far more than in fp32: near-ties are wider. The comparison is the
one of test_batched.py (every divergence from `none` alone must sit at a near-tie of the
reference), with its own threshold measured the same way (LogitTap).
"""

from __future__ import annotations

import copy
import logging

import pytest
import torch

import structspec.engine.model as model_module
from bench.exactness import bounded
from structspec.engine.engine import Request
from structspec.engine.model import check_bf16, from_model, load_model, resolve_dtype
from tests.conftest import deepjsoneval_rows
from tests.unit.engine.test_batched import DRAFT_LENS, compare_batched, options

# Near-tie threshold for the normal-init tiny model in bf16, from measurement (LogitTap): the
# same row's top-4 allowed logits batched vs alone differ by at most 3.9e-3 (1.2k rows, logits
# up to 0.62: one bf16 step at 0.5-1), so a divergence needs a gap below 7.8e-3; BF16_EPS is
# four times that (fp32's EPS in test_batched.py is 2.5e-6). As there, the measured difference
# must keep a margin of two under it.
BF16_EPS = 3.2e-2
DOCS = 16


def cpu_bf16_units(monkeypatch, present: bool):
    """Make torch report (or deny) AMX and AVX512-BF16 on this CPU."""
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: present)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)


# --- the dtype `auto` picks ---------------------------------------------------------------


@pytest.mark.parametrize("units", [True, False])
def test_auto_is_bf16_on_cpus_with_bf16_units_and_on_cuda_fp32_elsewhere(monkeypatch, units):
    cpu_bf16_units(monkeypatch, units)
    assert resolve_dtype("auto", torch.device("cpu")) == (torch.bfloat16 if units else torch.float32)
    assert resolve_dtype("auto", torch.device("cuda")) == torch.bfloat16
    # an explicit dtype is what runs, whatever the chip
    assert resolve_dtype("float32", torch.device("cpu")) == torch.float32
    assert resolve_dtype("bfloat16", torch.device("cpu")) == torch.bfloat16


@pytest.fixture(scope="module")
def tiny_dir(tiny_loaded, tmp_path_factory):
    """The peaky tiny model saved as a model directory, for load_model."""
    path = tmp_path_factory.mktemp("tiny-model")
    tiny_loaded.model.save_pretrained(path)
    tiny_loaded.tokenizer.save_pretrained(path)
    return path


def test_auto_on_a_bf16_cpu_keeps_bf16_after_the_check_and_says_so(monkeypatch, tiny_dir, tmp_path):
    cpu_bf16_units(monkeypatch, True)
    loaded = load_model(str(tiny_dir), device="cpu", dtype="auto", cache_dir=tmp_path)
    assert loaded.dtype == torch.bfloat16
    assert loaded.dtype_note.startswith("auto: bfloat16") and "check against fp32 passed" in loaded.dtype_note


def test_a_model_that_fails_the_check_runs_in_fp32_with_a_warning(monkeypatch, tiny_dir, tmp_path, caplog):
    cpu_bf16_units(monkeypatch, True)
    monkeypatch.setattr(model_module, "BF16_CHECK_GAP", -1.0)  # no model can pass: the fallback runs
    with caplog.at_level(logging.WARNING, logger=model_module.log.name):
        loaded = load_model(str(tiny_dir), device="cpu", dtype="auto", cache_dir=tmp_path)
    assert loaded.dtype == torch.float32 and all(p.dtype == torch.float32 for p in loaded.model.parameters())
    assert loaded.dtype_note.startswith("auto: float32 (bf16 failed the start-up check")
    assert "running in float32" in caplog.text


def test_without_bf16_units_auto_loads_fp32_and_skips_the_check(monkeypatch, tiny_dir, tmp_path):
    cpu_bf16_units(monkeypatch, False)

    def no_check(*a):
        raise AssertionError("the bf16 check ran on a CPU without bf16 units")

    monkeypatch.setattr(model_module, "check_bf16", no_check)
    loaded = load_model(str(tiny_dir), device="cpu", dtype="auto", cache_dir=tmp_path)
    assert loaded.dtype == torch.float32 and "no bf16 matrix units" in loaded.dtype_note
    asked = load_model(str(tiny_dir), device="cpu", dtype="bfloat16", cache_dir=tmp_path)
    assert asked.dtype == torch.bfloat16 and asked.dtype_note == "bfloat16 (asked for)"


@pytest.mark.model
def test_the_default_model_passes_the_bf16_check(default_engine):
    """The real model against the threshold: bf16 must keep fp32's top token at every position
    of the check prompt but near-ties (a wider gap would mean bf16 changes outputs)."""
    model = copy.deepcopy(default_engine.loaded.model)
    check = check_bf16(model, default_engine.loaded.tokenizer)
    print(f"\ndefault model, bf16 vs fp32 on the check prompt: {check}")
    assert next(model.parameters()).dtype == torch.bfloat16
    assert check.positions > 50 and check.ok, check
    assert check.max_diff > 0  # bf16 really ran: its logits are not fp32's


# --- bf16, batched against one document at a time -----------------------------------------


@pytest.fixture(scope="module")
def tiny_normal_bf16(tiny_normal_loaded):
    model = copy.deepcopy(tiny_normal_loaded.model).to(torch.bfloat16)
    return from_model(model, tiny_normal_loaded.tokenizer, name="tiny-random-normal-bf16")


@pytest.mark.long  # `make test` keeps the bf16 check on the default model and the bf16 kernel tests
def test_bf16_batched_matches_one_at_a_time_except_at_near_ties(tiny_normal_bf16, monkeypatch):
    rows = deepjsoneval_rows(DOCS)
    strategies = ("none", "schema", "ngram", "suffix", "composite")
    requests = [Request(bounded(row["schema"]), row["text"],
                        options(strategies[i % 5], DRAFT_LENS[i % len(DRAFT_LENS)], max_tokens=160))
                for i, row in enumerate(rows)]
    c = compare_batched(tiny_normal_bf16, requests, BF16_EPS, monkeypatch, "bf16", engine_max_seqs=8)
    tap, noise = c.tap, c.noise
    gaps = sorted(g for ref in c.refs for g in ref.margins)
    done_ref, done_batched = c.finished()
    print(f"\n{DOCS} documents, tiny normal-init model in bf16: {c.tally}; reference gaps below BF16_EPS: "
          f"{sum(g < BF16_EPS for g in gaps)} of {len(gaps)}; {noise}; "
          f"finished: one at a time {done_ref}/{DOCS}, batched {done_batched}/{DOCS}")
    assert next(tiny_normal_bf16.model.parameters()).dtype == torch.bfloat16
    # the threshold is honest: a divergence needs a gap below 2 * max |diff|, BF16_EPS is twice that
    assert tap.compared > 500 and tap.max_diff > 0 and 2 * tap.max_diff <= BF16_EPS / 2, noise
    for strategy in ("schema", "ngram", "suffix", "composite"):
        accepted = sum(res.stats.accepted for r, res in zip(requests, c.results) if r.options.strategy == strategy)
        assert accepted > 0, strategy
    assert done_ref >= 0.75 * DOCS and done_batched >= 0.75 * DOCS, (done_ref, done_batched)


# The same for the default model in bf16, measured: at most 0.5 over ~410 rows (logits up to 41,
# where bf16's step is 0.25: two steps), so a divergence needs a gap below 1.0; four times that.
# fp32's DEFAULT_MODEL_EPS is 6e-4: in bf16 most of these documents diverge somewhere (4 of 6
# when measured), each at a near-tie of this width.
DEFAULT_MODEL_BF16_EPS = 4.0
DEFAULT_MODEL_DOCS = 2


@pytest.mark.model
@pytest.mark.long  # `make test` keeps the bf16 check on the default model (test above)
def test_default_model_bf16_batched_matches_one_at_a_time(default_engine, monkeypatch):
    model = copy.deepcopy(default_engine.loaded.model).to(torch.bfloat16)
    loaded = from_model(model, default_engine.loaded.tokenizer, name="default-bf16")
    rows = deepjsoneval_rows(DEFAULT_MODEL_DOCS)
    # the three requests of a document share its prompt: one computes it, two copy it
    requests = [Request(bounded(row["schema"]), row["text"], options(strategy, DRAFT_LENS[(i + j) % 5], max_tokens=160),
                        reuse_prompt=True)
                for i, row in enumerate(rows) for j, strategy in enumerate(("schema", "ngram", "suffix", "composite"))]
    c = compare_batched(loaded, requests, DEFAULT_MODEL_BF16_EPS, monkeypatch, "default model bf16", engine_max_seqs=8)
    tally, tap, results, noise = c.tally, c.tap, c.results, c.noise
    (done_ref, done_batched), n = c.finished(), len(requests)
    print(f"\n{DEFAULT_MODEL_DOCS} documents x 4 strategies, default model in bf16: {tally}; {noise}; "
          f"finished: one at a time {done_ref}/{n}, batched {done_batched}/{n}")
    assert tap.compared > 100 and 2 * tap.max_diff <= tally.eps / 2, noise
    assert sum(res.stats.accepted for res in results) > 0
    assert done_ref >= 0.5 * n and done_batched >= 0.5 * n


@pytest.mark.parametrize("window", [None, 16])
def test_bf16_rows_attend_over_fp32_slots_as_sdpa_does_in_fp32(window):
    """kv_cache.upcast_ragged_attention (bf16/fp16 models on a CPU; their slots hold fp32) against
    torch's SDPA in fp32 on the same keys, one step of every kind of segment: a decode row, a
    5-row verification, a first prefill chunk (SDPA in bf16 over its own rows) and a 40-row
    later chunk (over its slot rounded down); grouped heads, causal and sliding-window masks."""
    import torch.nn.functional as F

    from structspec.engine.kv_cache import (KVLayout, LayerShape, Segment, Slot, Step, storage_dtype,
                                            upcast_ragged_attention)

    assert storage_dtype(torch.bfloat16, torch.device("cpu")) == torch.float32
    layout = KVLayout((LayerShape(3, 64, 64, storage_dtype(torch.bfloat16, torch.device("cpu"))),))
    gen = torch.Generator().manual_seed(7)
    shapes = [(1, 40), (5, 40), (6, 0), (40, 10)]  # (rows, past)
    segments, start = [], 0
    for rows, past in shapes:
        slot = Slot(layout, past + rows, torch.device("cpu"))
        slot.keys[0][:, :past] = torch.randn(3, past, 64, generator=gen)
        slot.values[0][:, :past] = torch.randn(3, past, 64, generator=gen)
        segments.append(Segment(slot, start, rows, past))
        start += rows
    q = torch.randn(1, 9, start, 64, generator=gen).bfloat16()
    k, v = torch.randn(1, 3, start, 64, generator=gen).bfloat16(), torch.randn(1, 3, start, 64, generator=gen).bfloat16()
    cached = [(seg.slot.keys[0][:, :seg.past].clone(), seg.slot.values[0][:, :seg.past].clone()) for seg in segments]
    got = upcast_ragged_attention(Step(segments), 0, q, k, v, window, 0.1)
    assert got.shape == (1, start, 9, 64) and got.dtype == torch.bfloat16
    for seg, (ck, cv) in zip(segments, cached):
        rows = slice(seg.start, seg.start + seg.rows)
        keys = torch.cat([ck, k[0, :, rows].float()], dim=1)
        values = torch.cat([cv, v[0, :, rows].float()], dim=1)
        assert torch.equal(seg.slot.keys[0][:, :seg.past + seg.rows], keys)  # the new rows were written
        mask = seg.mask(window, q.device)
        ref = F.scaled_dot_product_attention(q[:, :, rows].float(), keys[None], values[None], attn_mask=mask,
                                             is_causal=mask is None and seg.rows > 1, enable_gqa=True, scale=0.1)
        err = (got[0, rows].float() - ref[0].transpose(0, 1)).abs().max()
        assert err < 0.05, (seg.rows, seg.past, float(err))
