"""Per-(schema, strategy, draft_len) aggregates: exact totals (API, /metrics) and decayed
counts (the selector). Pure Python so the database repository and the simulations in the
unit tests fold jobs in with the same arithmetic.

Decay is counted in *requests of the schema*, not wall time: every arm of a schema loses a
factor gamma = 0.5 ** (1 / half_life) per request of that schema, pulled or not, so a stale
arm grows uncertain again and gets re-explored. Each arm stores the schema's request clock
at its last update (`seen_at`); its decayed counts are brought forward lazily.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

# Job latency histogram (seconds, created -> result stored). Stored per arm as non-cumulative
# counts, one more than the bounds (the last is +Inf); changing these needs a migration of data.
LATENCY_BUCKETS: tuple[float, ...] = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


# Verbatim requests (grammar/verbatim.py) accept drafts very differently from free ones, so
# their arms are kept apart: strategy "ngram" of a verbatim request is stored as "ngram+verbatim".
VERBATIM = "+verbatim"


def arm_strategy(stats: dict[str, Any]) -> str:
    """The strategy under which a job's stats are stored: verbatim jobs get their own arms."""
    return stats["strategy"] + (VERBATIM if stats.get("verbatim") else "")


def mode_views(views: list["ArmView"], verbatim: bool) -> list["ArmView"]:
    """The arms of one mode, named by their plain strategy (what the selector knows)."""
    out = []
    for v in views:
        if v.strategy.endswith(VERBATIM) == verbatim:
            plain = v.strategy[:-len(VERBATIM)] if verbatim else v.strategy
            out.append(dataclasses.replace(v, strategy=plain))
    return out


def decay_factor(half_life: float, steps: float) -> float:
    """gamma ** steps with gamma = 0.5 ** (1 / half_life); half_life <= 0 means no decay."""
    if half_life <= 0 or steps <= 0:
        return 1.0
    return 0.5 ** (steps / half_life)


def latency_bucket(seconds: float) -> int:
    for i, bound in enumerate(LATENCY_BUCKETS):
        if seconds <= bound:
            return i
    return len(LATENCY_BUCKETS)


@dataclass
class ArmAggregate:
    """Everything stored about one (strategy, draft_len) of one schema."""

    strategy: str
    draft_len: int
    requests: int = 0
    output_tokens: int = 0
    target_passes: int = 0
    proposed: int = 0
    accepted: int = 0
    decode_s: float = 0.0
    latency_s_sum: float = 0.0
    latency_buckets: list[int] = field(default_factory=lambda: [0] * (len(LATENCY_BUCKETS) + 1))
    proposed_by_position: list[int] = field(default_factory=list)
    accepted_by_position: list[int] = field(default_factory=list)
    # passes in which position i was offered (k > i) with 0..i-1 accepted: the trials of c_i
    reached_by_position: list[int] = field(default_factory=list)
    batch_size_sum: float = 0.0  # sum over requests of the job's mean batch size
    # decayed, as of schema request clock `seen_at`
    d_requests: float = 0.0
    d_passes: float = 0.0
    d_decode_s: float = 0.0
    d_accepted_by_position: list[float] = field(default_factory=list)
    d_reached_by_position: list[float] = field(default_factory=list)
    seen_at: int = 0

    def add(self, stats: dict[str, Any], clock: int, half_life: float, latency_s: float | None = None) -> None:
        """Fold one job's engine stats in. `clock`: the schema's request count before this job."""
        g = decay_factor(half_life, clock - self.seen_at)
        self.d_requests = self.d_requests * g + 1
        self.d_passes = self.d_passes * g + stats["target_passes"]
        self.d_decode_s = self.d_decode_s * g + stats["decode_s"]
        acc = list(stats.get("accepted_by_position") or [])
        prop = list(stats.get("proposed_by_position") or [])
        reached = job_reached(stats, self.draft_len)
        # every position list has one entry per stored position (a row of schema_position_stats)
        n = max(len(acc), len(prop), len(reached), len(self.proposed_by_position))
        for name, extra in (("proposed_by_position", prop), ("accepted_by_position", acc),
                            ("reached_by_position", reached)):
            setattr(self, name, _add_lists(getattr(self, name), extra, n))
        self.d_accepted_by_position = _add_lists([x * g for x in self.d_accepted_by_position], acc, n)
        self.d_reached_by_position = _add_lists([x * g for x in self.d_reached_by_position], reached, n)
        batch_size = stats.get("batch_size")  # absent: a job from before batching, decoded alone
        self.batch_size_sum += 1.0 if batch_size is None else float(batch_size)
        self.seen_at = clock + 1
        self.requests += 1
        self.output_tokens += stats["output_tokens"]
        self.target_passes += stats["target_passes"]
        self.proposed += stats["proposed"]
        self.accepted += stats["accepted"]
        self.decode_s += stats["decode_s"]
        if latency_s is not None:
            self.latency_s_sum += latency_s
            buckets = list(self.latency_buckets)
            buckets[latency_bucket(latency_s)] += 1
            self.latency_buckets = buckets

    def decayed(self, clock: int, half_life: float) -> "ArmView":
        """The decayed counts as of schema request clock `clock`."""
        g = decay_factor(half_life, clock - self.seen_at)
        passes = self.target_passes or 1
        # positions never drafted (stored only for their reached counts) add no share; an arm
        # that drafted nothing keeps an empty list, which PassCost prices at its k as before
        drafted = list(self.proposed_by_position)
        while drafted and not drafted[-1]:
            drafted.pop()
        return ArmView(self.strategy, self.draft_len, self.d_passes * g, self.d_decode_s * g,
                       [x * g for x in self.d_accepted_by_position], self.d_requests * g,
                       drafted_by_position=[p / passes for p in drafted],
                       reached_by_position=[x * g for x in self.d_reached_by_position])


@dataclass(frozen=True)
class ArmView:
    """What the selector sees of one arm: decayed passes, decode seconds and, per draft
    position i, passes in which position i was accepted (which implies 0..i-1 were) and
    passes in which it was reached (offered, with 0..i-1 accepted)."""

    strategy: str
    draft_len: int
    passes: float
    decode_s: float
    accepted_by_position: list[float]
    requests: float = 0.0
    # share of passes whose (grammar-cut) draft reached position i: exact totals, not decayed
    drafted_by_position: list[float] = field(default_factory=list)
    # decayed; None: not measured, the selector derives it from accepted_by_position as
    # job_reached does for a job from before the key
    reached_by_position: list[float] | None = None

    @property
    def drafted_per_pass(self) -> float:
        """Draft tokens the target verified per pass, on average (what a pass costs grows with)."""
        return sum(self.drafted_by_position)


def job_reached(stats: dict[str, Any], draft_len: int) -> list[int]:
    """A job's reached_by_position; for stats from before the key, derived as if every pass was
    offered its full `draft_len`: position 0 reached in every pass, position i when i-1 was
    accepted (a draft the grammar cut short still counts as reaching the next position)."""
    if stats.get("reached_by_position") is not None:
        return list(stats["reached_by_position"])
    acc = list(stats.get("accepted_by_position") or [])
    reached = [stats["target_passes"], *acc][:draft_len]
    if len(reached) > len(acc) and not reached[-1]:  # a position nothing reached: no entry needed
        reached.pop()
    return reached


def _add_lists(a: list, b: list, n: int) -> list:
    return [(a[i] if i < len(a) else 0) + (b[i] if i < len(b) else 0) for i in range(n)]


class InMemoryStats:
    """One stats key's arms kept in memory, folded with the same arithmetic as the database
    repository (benchmarks and the selector's simulations; the service uses the database)."""

    def __init__(self, half_life: float):
        self.half_life = half_life
        self.arms: dict[tuple[str, int], ArmAggregate] = {}
        self.clock = 0

    def views(self, verbatim: bool = False) -> list["ArmView"]:
        return mode_views([a.decayed(self.clock, self.half_life) for a in self.arms.values()], verbatim)

    def record(self, stats: dict) -> None:
        key = (arm_strategy(stats), stats["draft_len"])
        arm = self.arms.setdefault(key, ArmAggregate(*key))
        arm.add(stats, self.clock, self.half_life)
        self.clock += 1
