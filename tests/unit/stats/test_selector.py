"""The `auto` selector on simulated traffic: two schemas whose best strategies differ, a pass
cost that grows with k, convergence within a bounded number of requests, re-adaptation after
a traffic shift. Seeded: every run draws the same numbers."""

from __future__ import annotations

import dataclasses
import random
from collections import Counter

import pytest

from structspec.stats.aggregate import ArmAggregate, InMemoryStats, decay_factor
from structspec.stats.selector import (Choice, PassCost, Selector, SelectorConfig, drafted_shares,
                                       expected_tokens_per_pass, position_counts)

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


# the grammar cuts a draft to one of these lengths, drawn per pass (an old engine's stats)
CUTS = {"schema": (1, 2, 3, 5), "composite": (2, 4, 6), "ngram": (8,)}


def simulate_cut_job(profile: dict, choice: Choice, rng: random.Random) -> dict:
    """Stats as the engine before batching gave them (no reached_by_position, no batch_size):
    every pass offered the full k, the grammar cut the draft to a length from CUTS, and the
    position lists grow to the longest draft."""
    c, k = profile.get(choice.strategy, []), choice.draft_len
    tokens = passes = proposed = accepted = 0
    acc_pos, prop_pos = [], []
    while tokens < OUTPUT_TOKENS:
        passes += 1
        drafted = min(k, rng.choice(CUTS.get(choice.strategy, (0,))))
        n = 0
        while n < drafted and n < len(c) and rng.random() < c[n]:
            n += 1
        grow = drafted - len(prop_pos)
        if grow > 0:
            prop_pos += [0] * grow
            acc_pos += [0] * grow
        for i in range(drafted):
            prop_pos[i] += 1
            acc_pos[i] += i < n
        proposed += drafted
        accepted += n
        tokens += n + 1
    return {"strategy": choice.strategy, "draft_len": k, "output_tokens": tokens, "target_passes": passes,
            "proposed": proposed, "accepted": accepted, "decode_s": passes * pass_s(choice.strategy, k),
            "accepted_by_position": acc_pos, "proposed_by_position": prop_pos}


def simulate_batched_job(profile: dict, choice: Choice, rng: random.Random, offers: tuple[int, ...]) -> dict:
    """Stats as the batched engine gives them: each pass the scheduler offers k' = one of
    `offers` (at most k) draft positions; reached_by_position counts the passes that offered
    position i with 0..i-1 accepted (structspec/engine RequestStats.record_step)."""
    c, k = profile.get(choice.strategy, []), choice.draft_len
    tokens = passes = accepted = 0
    acc_pos, prop_pos, reached = [0] * k, [0] * k, [0] * k
    while tokens < OUTPUT_TOKENS:
        passes += 1
        offered = min(k, rng.choice(offers))
        n = 0
        while n < offered and n < len(c) and rng.random() < c[n]:
            n += 1
        for i in range(offered):
            prop_pos[i] += 1
            acc_pos[i] += i < n
            reached[i] += i <= n
        accepted += n
        tokens += n + 1
    return {"strategy": choice.strategy, "draft_len": k, "output_tokens": tokens, "target_passes": passes,
            "proposed": sum(prop_pos), "accepted": accepted, "decode_s": passes * pass_s(choice.strategy, k),
            "accepted_by_position": acc_pos, "proposed_by_position": prop_pos, "reached_by_position": reached,
            "batch_size": float(len(offers))}


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
    assert {c.strategy for c in picks[:4]} == {"schema", "ngram", "suffix", "composite"}  # probes first
    assert {c.draft_len for c in picks[:4]} == {4}  # nearest to probe_draft_len=8, ties to the shorter


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


def legacy_position_counts(arms, strategy: str, n: int) -> list[tuple[float, float]]:
    """position_counts before reached_by_position: trials of position i were the passes with
    i-1 accepted (all passes for i = 0), whatever was offered."""
    succ, trials = [0.0] * n, [0.0] * n
    for a in arms:
        if a.strategy != strategy:
            continue
        acc = a.accepted_by_position
        for i in range(min(n, a.draft_len)):
            s = acc[i] if i < len(acc) else 0.0
            t = a.passes if i == 0 else (acc[i - 1] if i - 1 < len(acc) else 0.0)
            succ[i] += min(s, t)
            trials[i] += t
    return list(zip(succ, trials))


def old_style_scenario() -> tuple[list[Choice], list[list[float]]]:
    """Thompson picks on two schemas (their traffic swaps half way), a third of the jobs
    grammar-cut, all with stats from before reached_by_position: the picks and each schema's
    final posterior-mean scores. The grid of that time (before `suffix`), so that the figures
    below still pin the arithmetic."""
    selector, rng = Selector(SelectorConfig(strategies=("schema", "ngram", "composite"))), random.Random(2024)
    schemas = [InMemoryStats(50), InMemoryStats(50)]
    picks = []
    for i in range(240):
        stats = schemas[i % 2]
        profile = COPY_HEAVY if (i % 2 == 0) == (i < 120) else STRUCTURE_HEAVY
        choice = selector.choose(stats.views(), rng)
        sim = simulate_job if i % 3 else simulate_cut_job
        stats.record(sim(profile, choice, rng))
        picks.append(choice)
    return picks, [[score for _, score in selector.scores(st.views())] for st in schemas]


# old_style_scenario() as computed by the selector at f19e0c0, before reached_by_position
BEFORE_REACHED_PICKS = {"composite:12": 1, "composite:4": 12, "composite:6": 72, "composite:8": 30, "ngram:12": 53,
                        "ngram:16": 1, "ngram:6": 3, "ngram:8": 27, "schema:6": 5, "schema:8": 36}
BEFORE_REACHED_SCORES = [
    [42.66577087780327, 53.906006163507094, 56.61905796953111, 55.63091142609845, 54.104725611418424,
     51.300091628940145, 49.003063937697945, 44.97404125691757, 41.55719726593465, 61.86384045231015,
     70.38295565909536, 75.43430191069375, 78.6460137958837, 82.43505608817915, 83.20905575275167,
     80.10908475717032, 71.01864123382185, 76.735539996617, 104.7046274436892, 123.4041399259246,
     137.8575687479784, 150.03363346528178, 148.35898581597294, 127.73093191788583, 111.8230379194174],
    [41.50195235230373, 61.7581055273561, 71.28518149414649, 75.70600398135316, 78.13572993962008,
     80.11131433026462, 78.44601240883658, 71.87104555736613, 65.97303851312029, 56.219692416711254,
     58.36569721153263, 56.69150478978811, 54.36286775069285, 50.00232335377694, 46.26730762767289,
     40.25263132576086, 35.62183503000649, 65.65722221684018, 77.89452219456618, 82.45240966422786,
     83.8393211359309, 82.39633205723656, 78.94125678971554, 71.91965764137049, 66.01967478170785]]


def test_stats_from_before_reached_choose_and_score_exactly_as_before():
    picks, scores = old_style_scenario()
    assert dict(Counter(f"{c.strategy}:{c.draft_len}" for c in picks)) == BEFORE_REACHED_PICKS
    assert scores == BEFORE_REACHED_SCORES  # exact: the same floats, not approximately


def test_reached_derived_from_old_stats_gives_the_old_trials_at_every_step():
    selector, rng = Selector(), random.Random(5)
    stats = InMemoryStats(HALF_LIFE)
    for i in range(120):
        views = stats.views()
        for s in ("schema", "ngram", "composite"):
            assert position_counts(views, s, 16) == legacy_position_counts(views, s, 16)
        choice = selector.choose(views, rng)
        stats.record((simulate_cut_job if i % 2 else simulate_job)(STRUCTURE_HEAVY, choice, rng))


def one_job_view(strategy: str, k: int, passes: int, accepted: list[int], proposed: list[int], reached: list[int]):
    """The selector's view of an arm that has recorded one job with these per-position counts."""
    arm = ArmAggregate(strategy, k)
    arm.add({"output_tokens": passes + sum(accepted), "target_passes": passes, "proposed": sum(proposed),
             "accepted": sum(accepted), "decode_s": 1.0, "accepted_by_position": accepted,
             "proposed_by_position": proposed, "reached_by_position": reached}, 0, 0)
    return arm.decayed(1, 0)


def test_position_counts_take_trials_from_reached_and_cap_successes_by_them():
    # 10 passes: 6 offered all 4 positions, 4 offered only 1; acceptance as the lists say
    view = one_job_view("ngram", 4, 10, accepted=[7, 3, 2, 0], proposed=[10, 6, 6, 6], reached=[10, 4, 3, 2])
    assert position_counts([view], "ngram", 5) == [(7, 10), (3, 4), (2, 3), (0, 2), (0, 0)]
    # the same passes judged the old way: position 1's 3 unoffered passes count as rejections
    assert legacy_position_counts([view], "ngram", 4)[1] == (3, 7)
    capped = dataclasses.replace(view, reached_by_position=[10, 2, 3, 2])
    assert position_counts([capped], "ngram", 2) == [(7, 10), (2, 2)]


def test_given_drafted_trials_are_bounded_by_the_passes_that_drafted_each_position():
    # 10 passes offered all 4 positions; 5 drafted nothing, 3 drafted 2 tokens, 2 drafted 1
    view = one_job_view("composite", 4, 10, accepted=[4, 2, 0, 0], proposed=[5, 3, 0, 0], reached=[10, 4, 2, 0])
    assert position_counts([view], "composite", 4) == [(4, 10), (2, 4), (0, 2), (0, 0)]
    # position 0: every pass with a draft reached it; 1: 3 drafted there (<= 4 reached); 2: none
    assert position_counts([view], "composite", 4, given_drafted=True) == [(4, 5), (2, 3), (0, 0), (0, 0)]
    old = dataclasses.replace(view, drafted_by_position=[])  # measured before drafted shares were
    assert position_counts([old], "composite", 4, given_drafted=True) == position_counts([old], "composite", 4)


def test_the_engine_gets_the_acceptance_of_drafts_that_exist_not_of_empty_positions():
    """A proposer that drafts nothing in half the passes and whose drafted tokens are accepted
    at 0.8: tokens per pass see c_0 near 0.4, but a draft the engine holds is accepted at 0.8,
    which is what its trimming must price (an empty position costs no row)."""
    stats, rng, k = InMemoryStats(0), random.Random(5), 4
    for _ in range(60):
        acc_pos, prop_pos, reached, passes, tokens, accepted = [0] * k, [0] * k, [0] * k, 0, 0, 0
        while tokens < OUTPUT_TOKENS:
            passes += 1
            drafted = 0 if rng.random() < 0.5 else rng.randint(1, k)
            n = 0
            while n < drafted and rng.random() < 0.8:
                n += 1
            for i in range(k):  # as RequestStats.record_step with every position offered
                reached[i] += i <= n
                prop_pos[i] += i < drafted
                acc_pos[i] += i < n
            accepted += n
            tokens += n + 1
        stats.record({"strategy": "composite", "draft_len": k, "output_tokens": tokens, "target_passes": passes,
                      "proposed": sum(prop_pos), "accepted": accepted, "decode_s": passes * 0.05,
                      "accepted_by_position": acc_pos, "proposed_by_position": prop_pos, "reached_by_position": reached})
    views, sel = stats.views(), Selector()
    plain, drafted = sel.acceptance(views, "composite", k), sel.draft_acceptance(views, "composite", k)
    assert plain[0] == pytest.approx(0.4, abs=0.03)
    assert drafted[0] == pytest.approx(0.8, abs=0.03)  # exact at position 0
    assert all(d >= p for d, p in zip(drafted, plain))  # a bound elsewhere, never below c_i
    assert drafted[1] > plain[1]  # fewer passes drafted position 1 than reached it: the bound bites


def test_scheduler_shortened_drafts_are_not_counted_as_rejections():
    """Half the passes are offered 2 of k=8 positions: reached keeps c_2.. at the true 0.9;
    the old derivation would see c_2 near 0.45."""
    profile = {"ngram": [0.9] * 8}
    stats, rng = InMemoryStats(0), random.Random(17)
    for _ in range(200):
        stats.record(simulate_batched_job(profile, Choice("ngram", 8), rng, offers=(2, 8)))
    views = stats.views()
    curve = Selector().acceptance(views, "ngram", 8)
    assert curve == pytest.approx([0.9] * 8, abs=0.04)  # sigma ~0.01 at ~1000 trials
    legacy = Selector().acceptance([dataclasses.replace(v, reached_by_position=None) for v in views], "ngram", 8)
    assert legacy[2] < 0.6


def test_acceptance_is_the_posterior_mean_curve_the_scores_use():
    schema, rng = SimulatedSchema(COPY_HEAVY), random.Random(9)
    run_many(schema, Selector(), rng, 80)
    views, selector = schema.views(), Selector()
    cost = PassCost.fit(views, selector.cfg)
    scores = dict(selector.scores(views))
    for s in ("schema", "ngram", "composite"):
        c = selector.acceptance(views, s, 16)
        assert len(c) == 16 and all(0 < x < 1 for x in c)
        assert selector.acceptance(views, s, 4) == c[:4]
        q = drafted_shares(views, s, 16)
        for k in selector.cfg.draft_lens:
            assert scores[Choice(s, k)] == expected_tokens_per_pass(c, k) / cost(s, sum(q[:k]))
    assert Selector().acceptance([], "ngram", 3) == [0.5, 0.5, 0.5]  # the prior before any data


def test_a_batch_of_a_new_schema_probes_every_proposer_while_none_is_recorded():
    """Jobs chosen together (one engine batch) count as uses of their strategy while pending."""
    import uuid

    from structspec.services.strategy import InFlight

    sel, rng, sid = Selector(), random.Random(0), uuid.uuid4()
    pending = InFlight()
    picks = []
    for _ in range(4):
        choice = sel.choose([], rng, pending=pending.pending(sid, False))
        pending.begin(sid, False, choice.strategy)
        picks.append(choice.strategy)
    assert picks == ["schema", "ngram", "suffix", "composite"]
    assert sel.choose([], rng).strategy == "schema"  # without the pending ones: the first probe again
    for s in picks:
        pending.end(sid, False, s)
    assert pending.pending(sid, False) == {}
    assert pending.pending(sid, True) == {}  # modes are kept apart
