"""Strategy selection for `strategy: auto`: Thompson sampling over per-position acceptance.

Model, per schema and proposer strategy s:
  c_i  = P(draft position i accepted | positions < i accepted), one Beta posterior per i,
         pooled over every draft length K > i measured for s (the first k tokens a proposer
         drafts do not depend on K). Successes: passes with i accepted; trials: passes that
         reached i, i.e. offered it (the step's k > i: the batched scheduler may offer an
         `auto` job fewer than its K) with 0..i-1 accepted. A draft the grammar cut short
         counts as a rejection, which is what tokens-per-pass needs; a position the scheduler
         did not offer is no trial. Arms measured before reached was recorded were offered K
         every pass: their trials are passes with i-1 accepted (i = 0: all passes).
         Each c_i's Beta prior is centred on the posterior mean of c_{i-1} (2 pseudo-passes), so
         positions no draft has reached yet inherit the acceptance measured just before them
         instead of a flat 1/2: otherwise a schema whose drafts are accepted 95% of the time at
         k=8 would never try k=12.
  E[tokens/pass | s, k] = 1 + sum_{i<k} prod_{j<=i} c_j
  n(s, k) draft tokens verified per pass: sum_{i<k} q_i, q_i the measured share of passes whose
         grammar-cut draft reached position i (pooled like c_i; unmeasured positions repeat the
         last measured share, 1 before any measurement).
  t(s, k) seconds per pass, a line a + b*n fitted by weighted least squares to the measured
         decode_s / target_passes of every arm of the schema against its measured n (a forward
         pass costs by the tokens it verifies, not by the k asked for: on a CPU 9 tokens cost
         ~2.5x one), plus a per-strategy offset (the proposer's own cost), with prior
         pseudo-passes that make the line grow with n.
Pick argmax_{s,k} E / t with c_i sampled from its posterior (Thompson) or at its mean (the
point estimate shown by the stats endpoint). `none` is the arm (none, 0): E = 1.
For an `auto` job the chosen strategy's c'_0..c'_{k-1} (`Selector.draft_acceptance`: c_i
conditioned on a token being drafted at i, a Thompson draw seeded by the job) go to the engine,
which picks each step's k by them and the batch's pass cost: it prices the draft tokens a
proposer made, so a pass with no draft must not count against them.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Iterable, Mapping, Sequence

from structspec.stats.aggregate import ArmView

PROPOSING = ("schema", "ngram", "suffix", "composite")


@dataclass(frozen=True)
class SelectorConfig:
    strategies: tuple[str, ...] = PROPOSING
    draft_lens: tuple[int, ...] = (1, 2, 3, 4, 6, 8, 12, 16)
    include_none: bool = True
    prior_alpha: float = 1.0  # Beta(1, 1) per position: a new schema explores every arm
    prior_beta: float = 1.0
    prior_pass_s: float = 0.05  # seconds per pass before anything is measured
    prior_slope: float = 0.03  # relative growth of pass cost per draft token (prior)
    prior_passes: float = 20.0  # weight of the cost prior, in passes, at k=0 and at k=prior_k
    prior_k: int = 16
    # A strategy whose decayed request count is below this is probed (at probe_draft_len)
    # before Thompson sampling: a new schema tries every proposer once, and one left unused
    # for ~log2(1/explore_floor) half-lives is tried again, so a traffic shift that favours
    # an unused proposer is noticed. Thompson alone rarely revisits a proposer whose Beta(1,1)
    # prior promises ~2 tokens/pass against a measured 6.
    explore_floor: float = 0.5
    probe_draft_len: int = 8


@dataclass(frozen=True)
class Choice:
    strategy: str
    draft_len: int


class PassCost:
    """Seconds per target pass as a function of (strategy, draft tokens verified per pass)."""

    def __init__(self, a: float, b: float, offsets: dict[str, float]):
        self.a, self.b, self.offsets = a, b, offsets

    def __call__(self, strategy: str, n: float) -> float:
        return max(self.a + self.b * n + self.offsets.get(strategy, 0.0), 1e-9)

    @classmethod
    def fit(cls, arms: Iterable[ArmView], cfg: SelectorConfig) -> "PassCost":
        # n: the draft tokens an arm's passes verified on average; an arm from before that was
        # recorded (no positions) counts as drafting its full k
        obs = [(a.strategy, a.drafted_per_pass if a.drafted_by_position else a.draft_len, a.decode_s / a.passes,
                a.passes) for a in arms if a.passes > 0]
        # prior level: the data's level if any (hardware-specific), else the configured one
        w_all = sum(w for *_, w in obs)
        a0 = (sum(w * t / (1 + cfg.prior_slope * k) for _, k, t, w in obs) / w_all) if w_all else cfg.prior_pass_s
        points = [(k, t, w) for _, k, t, w in obs]
        points += [(0, a0, cfg.prior_passes), (cfg.prior_k, a0 * (1 + cfg.prior_slope * cfg.prior_k), cfg.prior_passes)]
        a, b = _weighted_line(points)
        b = max(b, 0.0)
        offsets: dict[str, float] = {}
        for s in {s for s, *_ in obs}:
            rs = [(t - (a + b * k), w) for s2, k, t, w in obs if s2 == s]
            # shrunk toward 0 by prior_passes pseudo-passes of zero residual
            offsets[s] = sum(r * w for r, w in rs) / (sum(w for _, w in rs) + cfg.prior_passes)
        return cls(a, b, offsets)


def _weighted_line(points: Sequence[tuple[float, float, float]]) -> tuple[float, float]:
    sw = sum(w for _, _, w in points)
    mx = sum(w * x for x, _, w in points) / sw
    my = sum(w * y for _, y, w in points) / sw
    sxx = sum(w * (x - mx) ** 2 for x, _, w in points)
    sxy = sum(w * (x - mx) * (y - my) for x, y, w in points)
    b = sxy / sxx if sxx > 0 else 0.0
    return my - b * mx, b


def position_counts(arms: Iterable[ArmView], strategy: str, n: int,
                    given_drafted: bool = False) -> list[tuple[float, float]]:
    """(successes, trials) of c_i for i < n, pooled over the strategy's arms with K > i.

    given_drafted: the trials of c'_i, the acceptance of a draft token that exists (what the
    engine prices: it trims drafts the proposer made, and an empty position costs no row).
    c_i's trials include passes whose draft ended before position i; c'_i's are the passes that
    reached i *and* drafted a token there. That joint count is not stored, so it is bounded by
    the smaller of the two counts (reached i; drafted past i, from the arm's drafted shares):
    exact at position 0 (every pass with a draft reaches it), never below c_i elsewhere, and
    c_i itself where drafts usually run on. An arm measured before drafted shares were has none:
    its trials stay those of c_i."""
    succ, trials = [0.0] * n, [0.0] * n
    for a in arms:
        if a.strategy != strategy:
            continue
        acc, reached = a.accepted_by_position, a.reached_by_position
        drafted = a.drafted_by_position if given_drafted else []
        for i in range(min(n, a.draft_len)):
            s = acc[i] if i < len(acc) else 0.0
            if reached is not None:
                t = reached[i] if i < len(reached) else 0.0
            else:  # an arm measured before reached was: every pass offered the full K
                t = a.passes if i == 0 else (acc[i - 1] if i - 1 < len(acc) else 0.0)
            if drafted:  # shares of (decayed) passes; past the list nothing was drafted
                t = min(t, (drafted[i] if i < len(drafted) else 0.0) * a.passes)
            succ[i] += min(s, t)
            trials[i] += t
    return list(zip(succ, trials))


def drafted_shares(arms: Iterable[ArmView], strategy: str, n: int) -> list[float]:
    """q_i for i < n: the share of passes whose draft reached position i, pooled over the
    strategy's arms with K > i (weighted by passes); unmeasured positions repeat the last."""
    num, den = [0.0] * n, [0.0] * n
    for a in arms:
        if a.strategy != strategy or not a.drafted_by_position:
            continue
        for i in range(min(n, a.draft_len)):
            num[i] += (a.drafted_by_position[i] if i < len(a.drafted_by_position) else 0.0) * a.passes
            den[i] += a.passes
    out, last = [], 1.0
    for i in range(n):
        last = num[i] / den[i] if den[i] > 0 else last
        out.append(last)
    return out


def expected_tokens_per_pass(c: Sequence[float], k: int) -> float:
    total, run = 1.0, 1.0
    for i in range(k):
        run *= c[i]
        total += run
    return total


class Selector:
    def __init__(self, config: SelectorConfig | None = None):
        self.cfg = config or SelectorConfig()

    def choose(self, arms: Sequence[ArmView], rng: random.Random | None = None,
               draft_len: int | None = None, pending: Mapping[str, float] | None = None) -> Choice:
        """Thompson sample (rng given) or posterior mean (rng None) of the best arm; with
        `draft_len` given only the strategy is chosen, at that k (0: `none`). `pending`: jobs
        per strategy chosen but not recorded yet (running beside this one in a batch), which
        count as uses when probing, so a batch of a new schema probes every proposer."""
        if rng is not None:
            probe = self.probe(arms, draft_len, pending)
            if probe is not None:
                return probe
        best = self.scores(arms, rng, draft_len)
        return max(best, key=lambda item: item[1])[0]

    def probe(self, arms: Sequence[ArmView], draft_len: int | None = None,
              pending: Mapping[str, float] | None = None) -> Choice | None:
        """The least-used proposer (recorded or pending), if it is under the exploration floor."""
        cfg = self.cfg
        if draft_len is None:  # a draft length the selector may choose, nearest the probe's
            k = min(cfg.draft_lens, key=lambda d: (abs(d - cfg.probe_draft_len), d))
        else:
            k = draft_len
        if k <= 0:
            return None
        used = {s: 0.0 for s in cfg.strategies}
        for a in arms:
            if a.strategy in used:
                used[a.strategy] += a.requests
        for strategy, n in (pending or {}).items():
            if strategy in used:
                used[strategy] += n
        strategy = min(used, key=lambda s: used[s])  # ties: configured order
        return Choice(strategy, k) if used[strategy] < cfg.explore_floor else None

    def scores(self, arms: Sequence[ArmView], rng: random.Random | None = None,
               draft_len: int | None = None) -> list[tuple[Choice, float]]:
        """(arm, expected output tokens per second) for every candidate arm, in a fixed order."""
        cfg = self.cfg
        if draft_len is None:
            ks, with_none = list(cfg.draft_lens), cfg.include_none
        else:
            ks, with_none = ([draft_len] if draft_len > 0 else []), draft_len == 0
        cost = PassCost.fit(arms, cfg)
        out: list[tuple[Choice, float]] = []
        if with_none or not ks:
            out.append((Choice("none", 0), 1.0 / cost("none", 0)))
        if not ks:
            return out
        n = max(ks)
        for s in cfg.strategies:
            c = self.acceptance(arms, s, n, rng)
            q = drafted_shares(arms, s, n)
            for k in ks:
                out.append((Choice(s, k), expected_tokens_per_pass(c, k) / cost(s, sum(q[:k]))))
        return out

    def acceptance(self, arms: Sequence[ArmView], strategy: str, n: int,
                   rng: random.Random | None = None) -> list[float]:
        """c_0..c_{n-1} of `strategy`, an empty draft position counted as a rejection (what
        tokens per pass needs: `scores`). At the posterior means without an rng, or one
        Thompson draw with `rng`."""
        return self._draw(self._posteriors(arms, strategy, n), rng)

    def draft_acceptance(self, arms: Sequence[ArmView], strategy: str, n: int,
                         rng: random.Random | None = None) -> list[float]:
        """c'_0..c'_{n-1} of `strategy`: the acceptance of a draft token that exists, the curve
        the engine trims each step's draft by (position_counts(given_drafted=True)). A job's
        curve is one Thompson draw (`rng`): it then sometimes drafts where the means say it
        does not pay, so positions the engine would otherwise always trim keep being measured."""
        return self._draw(self._posteriors(arms, strategy, n, given_drafted=True), rng)

    @staticmethod
    def _draw(posteriors: list[tuple[float, float, float]], rng: random.Random | None) -> list[float]:
        return [rng.betavariate(a, b) if rng is not None else mean for a, b, mean in posteriors]

    def _posteriors(self, arms: Sequence[ArmView], strategy: str, n: int,
                    given_drafted: bool = False) -> list[tuple[float, float, float]]:
        """(alpha, beta, mean) of c_i's (or c'_i's) Beta posterior for i < n; each prior is
        centred on the mean before it."""
        cfg = self.cfg
        strength = cfg.prior_alpha + cfg.prior_beta
        out, mean = [], cfg.prior_alpha / strength
        for succ, trials in position_counts(arms, strategy, n, given_drafted):
            alpha = mean * strength + succ
            beta = (1 - mean) * strength + max(trials - succ, 0.0)
            mean = alpha / (alpha + beta)  # the next position's prior centre
            out.append((alpha, beta, mean))
        return out
