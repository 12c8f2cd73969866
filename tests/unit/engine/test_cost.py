"""Batch-aware draft lengths (structspec/engine/cost.py): the pass-cost curve and the choice of k."""

from __future__ import annotations

import itertools

import pytest

from structspec.engine.cost import PassCostCurve, choose_draft_lens, expected_tokens


def test_the_curve_is_the_prior_until_something_is_measured():
    curve = PassCostCurve(prior_fixed_s=0.05, prior_row_s=0.01)
    assert curve(1) == pytest.approx(0.06) and curve(9) == pytest.approx(0.14)


def test_the_curve_is_kept_per_batch_size_and_read_at_the_nearest_measured_one():
    curve = PassCostCurve()
    curve.observe(1, 0.10, seqs=1)
    curve.observe(8, 0.20, seqs=1)
    curve.observe(16, 0.30, seqs=16)
    curve.observe(32, 0.55, seqs=16)
    assert curve(4.5, seqs=1) == pytest.approx(0.15)  # linear between measured rows
    assert curve(16, seqs=16) == pytest.approx(0.30) and curve(24, seqs=16) == pytest.approx(0.425, rel=0.02)
    assert curve(16, seqs=13) == pytest.approx(0.30)  # nearest measured batch size
    assert curve(16, seqs=1) < curve(16, seqs=16)  # 16 rows of one draft cost less than 16 sequences


def test_the_curve_follows_measurements_that_are_not_monotonic():
    """On a CPU a 3-row pass can cost more than a 5-row one; the curve keeps what was measured
    (and a plan may skip the expensive sizes)."""
    curve = PassCostCurve(prior_row_s=0.01)
    for rows, s in ((1, 0.055), (3, 0.100), (5, 0.087), (17, 0.130)):
        curve.observe(rows, s)
    assert curve(3) == pytest.approx(0.100) and curve(5) == pytest.approx(0.087)
    assert curve(4) == pytest.approx(0.0935)  # linear between measured rows
    assert curve(19) == pytest.approx(0.160)  # past the last (17 rows sit in bucket 16): the prior's slope
    # acceptance 0.4: k = 1 or 2 (the slow 2-3 row passes) does not pay, k = 4 (5 rows) does
    assert choose_draft_lens([2], [[0.4] * 16], 1, curve) == [0]
    assert choose_draft_lens([16], [[0.4] * 16], 1, curve) == [4]


def test_exploring_tries_the_next_bucket_so_an_overestimate_gets_corrected():
    curve = PassCostCurve(prior_row_s=0.01)
    curve.observe(1, 0.05)
    curve.observe(3, 0.50)  # one bad measurement: k=2 looks ruinous, and larger k past it too
    acc = [[0.9] * 16]
    assert choose_draft_lens([16], acc, 1, curve) == [0]
    assert choose_draft_lens([16], acc, 1, curve, explore=True) == [1]  # rows 2: the next bucket
    curve.observe(2, 0.055)
    assert choose_draft_lens([16], acc, 1, curve) == [1]
    assert choose_draft_lens([16], acc, 1, curve, explore=True) == [2]  # rows 3, the overestimate
    for _ in range(20):  # what exploring measures there washes the bad value out
        curve.observe(3, 0.058)
    assert curve(3) < 0.07
    [k] = choose_draft_lens([16], acc, 1, curve)  # rows 3 and past it are in play again
    assert k >= 2 and k == max(range(17), key=lambda j: (expected_tokens(acc[0], j) / curve(1 + j), -j))
    # past 8 rows the buckets are geometric: exploring jumps to the next bucket, not the next row
    big = PassCostCurve(prior_row_s=1.0)
    big.observe(9, 0.1)
    ks = choose_draft_lens([16], acc, 1, big, explore=True)
    assert ks[0] + 1 > 9 and big.bucket(ks[0] + 1) > big.bucket(9)
    assert choose_draft_lens([4], [[0.0] * 4], 1, big, explore=True) == [0]  # nothing to gain: no draft


def test_new_observations_move_a_bucket_by_the_moving_average():
    curve = PassCostCurve(alpha=0.5)
    curve.observe(1, 0.1)
    curve.observe(1, 0.3)
    assert curve.snapshot() == {1: {1: pytest.approx(0.2)}} and curve.snapshot(seqs=4) == {1: pytest.approx(0.2)}


def test_expected_tokens_of_a_draft():
    assert expected_tokens([0.5, 0.5], 0) == 1
    assert expected_tokens([0.5, 0.5], 2) == pytest.approx(1 + 0.5 + 0.25)
    assert expected_tokens([0.9], 3) == pytest.approx(1 + 0.9 + 0.81 + 0.729)  # the last value repeats


def test_fixed_sequences_keep_their_drafts_and_adaptive_ones_follow_the_cost():
    cheap = PassCostCurve(prior_fixed_s=0.1, prior_row_s=1e-4)  # the weights dominate: rows are nearly free
    by_rows = PassCostCurve(prior_fixed_s=0.0, prior_row_s=0.05)  # every row costs the same
    good, poor = [0.9] * 8, [0.1] * 8
    assert choose_draft_lens([8, 8], [None, good], 2, cheap) == [8, 8]
    # when a pass costs by its rows alone, a draft token (accepted with p < 1) yields less than
    # the row it takes: nothing is drafted, however good the acceptance
    assert choose_draft_lens([8], [good], 1, by_rows) == [0]
    assert choose_draft_lens([8, 8], [poor, good], 2, cheap)[1] == 8
    assert choose_draft_lens([4], [[0.0] * 4], 1, cheap) == [0]  # nothing is ever accepted


def test_with_one_sequence_k_maximises_expected_tokens_per_second():
    curve = PassCostCurve()
    for rows, s in ((1, 0.10), (2, 0.20), (5, 0.21), (9, 0.30)):
        curve.observe(rows, s)
    for acc in ([0.9] * 8, [0.6] * 8, [0.95, 0.5, 0.3, 0.2, 0.1, 0.1, 0.1, 0.1]):
        [k] = choose_draft_lens([8], [acc], 1, curve)
        best = max(range(9), key=lambda j: (expected_tokens(acc, j) / curve(1 + j), -j))
        assert k == best, acc


def test_the_batch_plan_is_the_best_of_every_allocation():
    """Brute force over all k vectors of a small batch: the greedy plan is optimal."""
    curve = PassCostCurve()
    for rows, s in ((3, 0.3), (6, 0.36), (9, 0.5), (12, 0.7)):
        curve.observe(rows, s, seqs=3)
    accs = [[0.9, 0.8, 0.7], [0.5, 0.4, 0.3], [0.2, 0.1, 0.1]]
    caps = [3, 3, 2]

    def rate(ks):
        total = sum(expected_tokens(a, k) for a, k in zip(accs, ks))
        return total / curve(3 + sum(ks), seqs=3)

    ks = choose_draft_lens(caps, accs, 3, curve)
    best = max(rate(list(v)) for v in itertools.product(*(range(c + 1) for c in caps)))
    assert rate(ks) == pytest.approx(best)


def test_a_step_that_is_mostly_prefill_drafts_only_what_is_nearly_sure():
    """Prefill rows are work done, like emitted tokens: beside a 512-row chunk a draft row costs
    what a prefill row costs, so 0.8-acceptance drafts that pay in a decode-only step do not pay
    there; a forced token (acceptance 1.0) still does."""
    curve = PassCostCurve(prior_fixed_s=0.05, prior_row_s=0.01)
    acc = [[0.8] * 8] * 4
    assert all(k >= 2 for k in choose_draft_lens([8] * 4, acc, 4, curve))  # decode only: drafts pay
    assert choose_draft_lens([8] * 4, acc, 4 + 512, curve, prefill_rows=512) == [0] * 4
    sure = [[1.0] * 8] * 4
    assert choose_draft_lens([8] * 4, sure, 4 + 512, curve, prefill_rows=512) == [8] * 4
