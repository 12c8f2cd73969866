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
    curve.observe(16, 0.24, seqs=1)
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
    # past the last (17 rows sit in bucket 16): the curve's own slope, the secant from its first point
    assert curve(19) == pytest.approx(0.130 + 3 * (0.130 - 0.055) / 15)
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


def test_past_the_measured_rows_a_pass_grows_by_the_curves_own_slope_not_the_priors():
    """The curve a 32-sequence batch learnt on a 2-core CPU (rows 32-54, ~0.7 ms a row) with the
    prior's 10 ms a row: drafts of 30 sequences that reach 90 rows pay by the measured slope,
    so the plan keeps them all (the prior's slope past 54 rows had trimmed them to ~22)."""
    curve = PassCostCurve(prior_fixed_s=0.05, prior_row_s=0.01)
    for rows, ms in ((32, 98.5), (38, 101.1), (45, 104.3), (54, 114.7)):
        curve.observe(rows, ms / 1000, seqs=32)
    slope = (0.1147 - 0.0985) / (54 - 32)
    assert curve(90, seqs=30) == pytest.approx(0.1147 + 36 * slope)
    assert choose_draft_lens([2] * 30, [[0.7, 0.7]] * 30, 30, curve, base_tokens=30) == [2] * 30
    # the slope is held between a quarter and all of the last point's seconds per row
    flat = PassCostCurve()
    flat.observe(8, 0.100)
    flat.observe(64, 0.100)  # two points, no growth measured: rows are not free past them
    assert flat(128) == pytest.approx(0.100 + 64 * 0.25 * 0.100 / 64)
    steep = PassCostCurve()
    steep.observe(1, 0.001)
    steep.observe(8, 0.100)  # a secant above the average per row (a noisy first point)
    assert steep(16) == pytest.approx(0.100 + 8 * 0.100 / 8)
    one = PassCostCurve(prior_row_s=1.0)
    one.observe(8, 0.08)  # one point: its average per row
    assert one(16) == pytest.approx(0.08 + 8 * 0.01)


def test_a_sequence_count_measured_at_one_row_count_grows_by_the_other_counts_slope():
    """After a batch of 32 that drafted nothing, its one point (32 rows, 44 ms) must not price a
    row at its average (1.4 ms: no fixed part) when other counts measured ~0.4 ms a row: the
    next batch's drafts would be trimmed to a fraction of what pays."""
    curve = PassCostCurve()
    for rows, ms in ((1, 15.0), (8, 17.8), (16, 21.0)):  # one at a time: 0.4 ms a row
        curve.observe(rows, ms / 1000, seqs=1)
    for rows, ms in ((4, 17.9), (32, 29.1)):  # two sequences: 0.4 ms a row
        curve.observe(rows, ms / 1000, seqs=2)
    curve.observe(5, 30.0 / 1000, seqs=4)  # a third count, measured once: no slope of its own
    curve.observe(32, 44.0 / 1000, seqs=32)
    assert curve.pooled_slope() == pytest.approx(0.0004)
    assert curve(96, seqs=32) == pytest.approx(0.044 + 64 * 0.0004)
    # with that price, 32 sequences' drafts at acceptance 0.8 are kept whole (the average per
    # row kept none of them)
    assert choose_draft_lens([3] * 32, [[0.8] * 3] * 32, 32, curve, base_tokens=32) == [3] * 32
    alone = PassCostCurve()
    alone.observe(32, 0.044, seqs=32)
    assert alone.pooled_slope() is None and alone(96, seqs=32) == pytest.approx(0.044 + 64 * 0.044 / 32)
    assert choose_draft_lens([3] * 32, [[0.8] * 3] * 32, 32, alone, base_tokens=32) == [0] * 32
    # the pooled slope stays within a quarter and all of the point's own average per row
    steep = PassCostCurve()
    steep.observe(1, 0.001, seqs=1)
    steep.observe(8, 0.100, seqs=1)  # 14 ms a row
    steep.observe(32, 0.044, seqs=32)
    assert steep(64, seqs=32) == pytest.approx(0.044 + 32 * 0.044 / 32)


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


def test_beside_a_prefill_chunk_drafts_are_planned_as_for_the_decode_rows_alone():
    """A draft row beside a 512-row chunk costs what it adds to a decode pass and its token saves
    a later decode row: the plan is the decode-only step's, neither everything (a row is not
    1/516 of the pass) nor only what is nearly sure (a prefill row is not worth a token)."""
    curve = PassCostCurve()
    for rows, s in ((4, 0.040), (8, 0.046), (16, 0.060), (32, 0.090)):
        curve.observe(rows, s, seqs=4)
    for acc in ([[0.8] * 8] * 4, [[0.3] * 8] * 4, [[0.95, 0.5, 0.2, 0.1] + [0.1] * 4] * 4):
        decode = choose_draft_lens([8] * 4, acc, 4, curve)
        assert choose_draft_lens([8] * 4, acc, 4 + 512, curve, prefill_rows=512) == decode, acc
    assert sum(choose_draft_lens([8] * 4, [[0.8] * 8] * 4, 4 + 512, curve, prefill_rows=512)) > 4
    assert choose_draft_lens([8] * 4, [[0.05] * 8] * 4, 4 + 512, curve, prefill_rows=512) == [0] * 4


def test_a_proposers_confidence_replaces_the_average_acceptance_token_by_token():
    # two sequences with the same schema average (0.6 a position): alike, each gets 2 draft tokens
    curve = PassCostCurve(prior_fixed_s=0.05, prior_row_s=0.01)
    acc = [[0.6] * 4, [0.6] * 4]
    assert choose_draft_lens([4, 4], acc, 2, curve) == [2, 2]
    # one drafts a stretch of earlier outputs' layout its voters agree on, the other a guess few
    # of them share (a stretch's share on its first token, 1.0 on the rest): the sure one is kept
    # whole, the guess is dropped
    sure, guess = [0.97, 1.0, 1.0, 1.0], [0.35, 1.0, 1.0, 1.0]
    assert choose_draft_lens([4, 4], acc, 2, curve, confidence=[sure, guess]) == [4, 0]
    # tokens the proposer says nothing about keep the average
    assert choose_draft_lens([4, 4], acc, 2, curve, confidence=[[None] * 4, []]) == [2, 2]
    assert choose_draft_lens([4, 4], acc, 2, curve, confidence=[None, None]) == [2, 2]
