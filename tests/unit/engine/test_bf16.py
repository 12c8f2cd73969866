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
from structspec.engine.engine import Request
from structspec.engine.model import check_bf16, from_model, load_model, resolve_dtype
from structspec.bench.exactness import bounded
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


def test_bf16_batched_matches_one_at_a_time_except_at_near_ties(tiny_normal_bf16, monkeypatch):
    rows = deepjsoneval_rows(DOCS)
    strategies = ("none", "schema", "ngram", "composite")
    requests = [Request(bounded(row["schema"]), row["text"],
                        options(strategies[i % 4], DRAFT_LENS[i % len(DRAFT_LENS)], max_tokens=160))
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
    for strategy in ("schema", "ngram", "composite"):
        accepted = sum(res.stats.accepted for r, res in zip(requests, c.results) if r.options.strategy == strategy)
        assert accepted > 0, strategy
    assert done_ref >= 0.75 * DOCS and done_batched >= 0.75 * DOCS, (done_ref, done_batched)


# The same for the default model in bf16, measured: at most 0.5 over ~410 rows (logits up to 41,
# where bf16's step is 0.25: two steps), so a divergence needs a gap below 1.0; four times that.
# fp32's DEFAULT_MODEL_EPS is 4e-4: in bf16 most of these documents diverge somewhere (4 of 6
# when measured), each at a near-tie of this width.
DEFAULT_MODEL_BF16_EPS = 4.0
DEFAULT_MODEL_DOCS = 2


@pytest.mark.model
def test_default_model_bf16_batched_matches_one_at_a_time(default_engine, monkeypatch):
    model = copy.deepcopy(default_engine.loaded.model).to(torch.bfloat16)
    loaded = from_model(model, default_engine.loaded.tokenizer, name="default-bf16")
    rows = deepjsoneval_rows(DEFAULT_MODEL_DOCS)
    requests = [Request(bounded(row["schema"]), row["text"], options(strategy, DRAFT_LENS[(i + j) % 5], max_tokens=160))
                for i, row in enumerate(rows) for j, strategy in enumerate(("schema", "ngram", "composite"))]
    c = compare_batched(loaded, requests, DEFAULT_MODEL_BF16_EPS, monkeypatch, "default model bf16", engine_max_seqs=8)
    tally, tap, results, noise = c.tally, c.tap, c.results, c.noise
    (done_ref, done_batched), n = c.finished(), len(requests)
    print(f"\n{DEFAULT_MODEL_DOCS} documents x 3 strategies, default model in bf16: {tally}; {noise}; "
          f"finished: one at a time {done_ref}/{n}, batched {done_batched}/{n}")
    assert tap.compared > 100 and 2 * tap.max_diff <= tally.eps / 2, noise
    assert sum(res.stats.accepted for res in results) > 0
    assert done_ref >= 0.5 * n and done_batched >= 0.5 * n


@pytest.mark.parametrize("rows, past, window", [(1, 40, None), (5, 40, None), (5, 40, 16), (1, 40, 16)])
def test_the_upcast_attention_of_bf16_decode_rows_is_sdpa_in_fp32(rows, past, window):
    """kv_cache.upcast_attention (bf16/fp16 decode and verification rows on a CPU) against
    torch's SDPA on the same fp32 inputs: grouped heads, causal and sliding-window masks."""
    import torch.nn.functional as F

    from structspec.engine.kv_cache import Segment, upcast_attention

    gen = torch.Generator().manual_seed(rows * 100 + past)
    length = past + rows
    q = torch.randn(1, 9, rows, 64, generator=gen)
    k, v = torch.randn(3, length, 64, generator=gen), torch.randn(3, length, 64, generator=gen)
    mask = Segment(slot=None, start=0, rows=rows, past=past).mask(window, q.device)
    assert (mask is None) == (rows == 1 and window is None)
    ref = F.scaled_dot_product_attention(q, k[None], v[None], attn_mask=mask, enable_gqa=True, scale=0.1)
    assert (upcast_attention(q, k, v, mask, 0.1) - ref).abs().max() < 1e-5
    got = upcast_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), mask, 0.1)
    assert got.dtype == torch.bfloat16 and (got.float() - ref).abs().max() < 0.05
