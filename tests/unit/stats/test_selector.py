"""The `auto` selector on simulated traffic: two schemas whose best strategies differ, a pass
cost that grows with k, convergence within a bounded number of requests, re-adaptation after
a traffic shift. Seeded: every run draws the same numbers."""

from __future__ import annotations

import random

import pytest

from structspec.stats.aggregate import ArmAggregate, InMemoryStats, decay_factor
from structspec.stats.selector import (Choice, PassCost, Selector, SelectorConfig, expected_tokens_per_pass,
                                       position_counts)

# conditional acceptance c_i per strategy; positions past the list are never accepted
STRUCTURE_HEAVY = {"schema": [0.97, 0.95, 0.93, 0.9, 0.88, 0.85, 0.6, 0.4, 0.3, 0.2],
                   "composite": [0.95, 0.92, 0.9, 0.85, 0.8, 0.75, 0.5, 0.3, 0.2, 0.1],
                   "ngram": [0.35, 0.3, 0.25, 0.2]}
COPY_HEAVY = {"schema": [0.4, 0.3, 0.2],
              "composite": [0.6, 0.55, 0.5, 0.45, 0.4],
              "ngram": [0.95, 0.93, 0.92, 0.9, 0.9, 0.88, 0.85, 0.85, 0.8, 0.8, 0.75, 0.7]}
OUTPUT_TOKENS = 80
HALF_LIFE = 150


def pass_s(strategy: str, k: int) -> float:
    """Simulated hardware: 20 ms a pass, +8% per draft token, +1 ms for the composite proposer."""
    return 0.02 * (1 + 0.08 * k) + (0.001 if strategy == "composite" else 0.0)


def true_rate(profile: dict, choice: Choice) -> float:
    c = (profile.get(choice.strategy, []) + [0.0] * 64)[:64]
    return expected_tokens_per_pass(c, choice.draft_len) / pass_s(choice.strategy, choice.draft_len)


def best_rate(profile: dict, cfg: SelectorConfig) -> tuple[Choice, float]:
    arms = [Choice("none", 0)] + [Choice(s, k) for s in cfg.strategies for k in cfg.draft_lens]
    return max(((a, true_rate(profile, a)) for a in arms), key=lambda x: x[1])


def simulate_job(profile: dict, choice: Choice, rng: random.Random) -> dict:
    """One job's engine stats under `profile`, as ExtractStats.as_dict() would give them."""
    c = profile.get(choice.strategy, [])
    k = choice.draft_len
    tokens = passes = proposed = accepted = 0
    acc_pos, prop_pos = [0] * k, [0] * k
    while tokens < OUTPUT_TOKENS:
        passes += 1
        n = 0
        for i in range(k):
            prop_pos[i] += 1
            proposed += 1
        for i in range(k):
            if i < len(c) and rng.random() < c[i]:
                acc_pos[i] += 1
                n += 1
            else:
                break
        accepted += n
        tokens += n + 1
    return {"strategy": choice.strategy, "draft_len": k, "output_tokens": tokens, "target_passes": passes,
            "proposed": proposed, "accepted": accepted,
            "decode_s": passes * pass_s(choice.strategy, k) * rng.uniform(0.9, 1.1),
            "accepted_by_position": acc_pos, "proposed_by_position": prop_pos}


class SimulatedSchema(InMemoryStats):
    """One schema's aggregates in memory, fed by simulated jobs of `profile`."""

    def __init__(self, profile: dict):
        super().__init__(HALF_LIFE)
        self.profile = profile

    def run(self, selector: Selector, rng: random.Random) -> Choice:
        choice = selector.choose(self.views(), rng)
        self.record(simulate_job(self.profile, choice, rng))
        return choice


def run_many(schema: SimulatedSchema, selector: Selector, rng: random.Random, n: int) -> list[Choice]:
    return [schema.run(selector, rng) for _ in range(n)]


def assert_converged(schema: SimulatedSchema, selector: Selector, recent: list[Choice], winners: set[str],
                     within: float = 0.9):
    best, best_tps = best_rate(schema.profile, selector.cfg)
    assert best.strategy in winners  # the simulation itself is set up as the test claims
    share = sum(c.strategy in winners for c in recent) / len(recent)
    assert share >= 0.8, f"only {share:.0%} of recent picks in {winners}: {recent[-10:]}"
    # the point estimate's true throughput is close to the best achievable
    pick = selector.choose(schema.views())
    assert pick.strategy in winners and true_rate(schema.profile, pick) >= within * best_tps, (pick, best)
    # and throughput over recent requests is near the optimum (exploration costs little)
    mean = sum(true_rate(schema.profile, c) for c in recent) / len(recent)
    assert mean >= 0.8 * best_tps, (mean, best_tps)


def test_auto_converges_per_schema_and_readapts_after_traffic_shift():
    selector, rng = Selector(), random.Random(1234)
    structured, copying = SimulatedSchema(STRUCTURE_HEAVY), SimulatedSchema(COPY_HEAVY)
    picks_s = run_many(structured, selector, rng, 300)
    picks_c = run_many(copying, selector, rng, 300)
    assert_converged(structured, selector, picks_s[-100:], {"schema", "composite"})
    assert_converged(copying, selector, picks_c[-100:], {"ngram"})
    assert 2 <= selector.choose(structured.views()).draft_len <= 8
    assert selector.choose(copying.views()).draft_len >= 4

    copying.profile = STRUCTURE_HEAVY  # the copy-heavy schema's traffic turns structure-heavy
    picks = run_many(copying, selector, rng, 400)
    # composite (87% of the best schema arm here) is an acceptable landing after a shift
    assert_converged(copying, selector, picks[-100:], {"schema", "composite"}, within=0.85)


def test_auto_notices_when_an_unused_strategy_becomes_the_best():
    """The harder shift: the winner does not degrade at all, but a proposer the selector
    stopped using becomes better; decay makes it probe that proposer again."""
    selector, rng = Selector(), random.Random(99)
    structured = SimulatedSchema(STRUCTURE_HEAVY)
    run_many(structured, selector, rng, 300)
    structured.profile = {**STRUCTURE_HEAVY, "ngram": [0.98] * 16}  # ~1.3x the best schema arm
    picks = run_many(structured, selector, rng, 800)  # ~5 half-lives: re-probe, then take over
    assert_converged(structured, selector, picks[-100:], {"ngram"})


def test_selection_is_deterministic_under_a_seed():
    def trace(seed):
        schema, rng = SimulatedSchema(COPY_HEAVY), random.Random(seed)
        return run_many(schema, Selector(), rng, 60)

    assert trace(7) == trace(7)
    assert trace(7) != trace(8)


def test_new_schema_explores_every_strategy_first():
    schema, rng = SimulatedSchema(STRUCTURE_HEAVY), random.Random(3)
    picks = run_many(schema, Selector(), rng, 40)
    assert {"schema", "ngram", "composite"} <= {c.strategy for c in picks}


def test_pass_cost_is_learned_from_measurements_and_grows_with_k():
    schema, rng = SimulatedSchema(COPY_HEAVY), random.Random(5)
    for s in ("schema", "ngram"):
        for k in (1, 4, 8, 16):
            arm = schema.arms.setdefault((s, k), ArmAggregate(s, k))
            for _ in range(5):
                arm.add(simulate_job(COPY_HEAVY, Choice(s, k), rng), schema.clock, HALF_LIFE)
                schema.clock += 1
    cost = PassCost.fit(schema.views(), SelectorConfig(prior_pass_s=1.0))  # a far-off prior loses to data
    for k in (0, 4, 16):
        assert cost("ngram", k) == pytest.approx(pass_s("ngram", k), rel=0.1)
    assert cost("ngram", 16) > 1.8 * cost("ngram", 0)


def test_prior_cost_grows_with_k_before_any_measurement():
    cost = PassCost.fit([], SelectorConfig())
    assert cost("schema", 16) > cost("schema", 8) > cost("schema", 0) > 0


def test_position_posteriors_pool_draft_lengths_and_condition_on_the_previous_position():
    arm4 = ArmAggregate("ngram", 4)
    arm4.add({"output_tokens": 10, "target_passes": 10, "proposed": 40, "accepted": 14, "decode_s": 1.0,
              "accepted_by_position": [8, 4, 2, 0], "proposed_by_position": [10] * 4}, 0, 0)
    arm2 = ArmAggregate("ngram", 2)
    arm2.add({"output_tokens": 10, "target_passes": 10, "proposed": 20, "accepted": 10, "decode_s": 1.0,
              "accepted_by_position": [6, 4], "proposed_by_position": [10] * 2}, 1, 0)
    views = [arm4.decayed(2, 0), arm2.decayed(2, 0)]
    assert position_counts(views, "ngram", 4) == [(14, 20), (8, 14), (2, 4), (0, 2)]
    assert position_counts(views, "schema", 2) == [(0, 0), (0, 0)]


def test_decay_halves_counts_after_half_life_requests_of_the_schema():
    arm = ArmAggregate("schema", 2)
    arm.add({"output_tokens": 4, "target_passes": 2, "proposed": 4, "accepted": 2, "decode_s": 0.5,
             "accepted_by_position": [2, 0], "proposed_by_position": [2, 2]}, 0, 10)
    view = arm.decayed(11, 10)
    assert view.passes == pytest.approx(1.0) and view.accepted_by_position == pytest.approx([1.0, 0.0])
    assert arm.target_passes == 2 and arm.requests == 1  # exact totals never decay
    assert decay_factor(10, 20) == pytest.approx(0.25)


def test_a_given_draft_len_fixes_k_and_the_selector_picks_only_the_strategy():
    schema, rng = SimulatedSchema(COPY_HEAVY), random.Random(9)
    run_many(schema, Selector(), rng, 100)
    picks = [Selector().choose(schema.views(), rng, draft_len=3) for _ in range(20)]
    assert {c.draft_len for c in picks} == {3} and "ngram" in {c.strategy for c in picks}
    assert Selector().choose(schema.views(), rng, draft_len=0) == Choice("none", 0)


def test_every_pick_is_an_arm_of_the_configured_grid():
    """Probing a new schema included: a grid without the probe's default k never gets it."""
    cfg = SelectorConfig(draft_lens=(2, 4, 12))
    schema, rng = SimulatedSchema(STRUCTURE_HEAVY), random.Random(11)
    picks = run_many(schema, Selector(cfg), rng, 30)
    assert {c.draft_len for c in picks} <= {0, 2, 4, 12}
    assert {c.strategy for c in picks[:3]} == {"schema", "ngram", "composite"}  # probes first
    assert {c.draft_len for c in picks[:3]} == {4}  # nearest to probe_draft_len=8, ties to the shorter


def test_verbatim_jobs_fold_into_their_own_arms_and_the_selector_sees_one_mode():
    from structspec.stats.aggregate import arm_strategy, mode_views

    job = {"strategy": "ngram", "draft_len": 4, "output_tokens": 10, "target_passes": 2, "proposed": 8,
           "accepted": 8, "decode_s": 0.1, "accepted_by_position": [2, 2, 2, 2], "proposed_by_position": [2] * 4}
    free, verbatim = ArmAggregate(arm_strategy(job), 4), ArmAggregate(arm_strategy({**job, "verbatim": True}), 4)
    assert (free.strategy, verbatim.strategy) == ("ngram", "ngram+verbatim")
    free.add(job, 0, 0)
    verbatim.add({**job, "verbatim": True}, 1, 0)
    views = [free.decayed(2, 0), verbatim.decayed(2, 0)]
    assert [(v.strategy, v.requests) for v in mode_views(views, False)] == [("ngram", 1)]
    assert [(v.strategy, v.requests) for v in mode_views(views, True)] == [("ngram", 1)]
    assert mode_views([free.decayed(2, 0)], True) == []  # a new mode starts from nothing


def test_auto_drafts_past_the_probe_length_when_deep_positions_keep_being_accepted():
    """Acceptance 0.98 at every position: k=16 is best. Positions past the probe's k=8 are only
    reached by trying, and their prior follows the acceptance measured before them."""
    profile = {"composite": [0.98] * 16, "schema": [0.6, 0.5], "ngram": [0.4]}
    cfg = SelectorConfig()
    best, best_tps = best_rate(profile, cfg)
    assert best == Choice("composite", 16)
    schema, rng = SimulatedSchema(profile), random.Random(21)
    picks = run_many(schema, Selector(cfg), rng, 200)
    pick = Selector(cfg).choose(schema.views())
    assert pick.strategy == "composite" and pick.draft_len >= 12, pick
    assert true_rate(profile, pick) >= 0.9 * best_tps
    assert sum(true_rate(profile, c) for c in picks[-50:]) / 50 >= 0.85 * best_tps


def test_pass_cost_follows_the_tokens_verified_not_the_k_asked_for():
    """A proposer whose drafts are mostly cut short costs what it verifies."""
    cheap = ArmAggregate("ngram", 16)  # asked for 16, verified ~2 a pass
    full = ArmAggregate("composite", 4)  # asked for 4, verified 4 a pass
    for arm, drafted, per_pass in ((cheap, [10, 10, 0, 0] + [0] * 12, 0.030), (full, [10] * 4, 0.050)):
        arm.add({"output_tokens": 20, "target_passes": 10, "proposed": sum(drafted), "accepted": 0,
                 "decode_s": 10 * per_pass, "accepted_by_position": [0] * len(drafted),
                 "proposed_by_position": drafted}, 0, 0)
    views = [cheap.decayed(2, 0), full.decayed(2, 0)]
    assert views[0].drafted_per_pass == pytest.approx(2.0) and views[1].drafted_per_pass == pytest.approx(4.0)
    cost = PassCost.fit(views, SelectorConfig(prior_passes=0.1))
    assert cost.b > 0.005  # ~10 ms per verified token: the slope is seen across the two arms
