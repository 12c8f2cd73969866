"""Batch-aware draft lengths: a measured pass-cost curve and the per-step choice of k.

A forward pass costs by the rows it verifies, not by any one sequence's k: on a CPU the
weights are read once per pass (the fixed part) and every row adds compute. So a draft
token that pays at batch 1 may not pay at batch 32. Each step every adaptive (`auto`)
sequence first proposes up to its draft_len; the engine then keeps k_b tokens of each draft
so as to maximise the batch's expected output tokens per second over the rows that exist:

    (sum_b E_b(k_b)) / cost(base_rows + sum_b k_b),   E_b(k) = 1 + sum_{i<k} prod_{j<=i} c_b[j]

c_b is the sequence's per-position acceptance of a token its proposer did draft, given the
ones before it were accepted (its schema's statistics for its strategy,
Selector.draft_acceptance): a pass whose proposer drafted nothing at a position is no trial
there, since that position costs no row. (Counting it as a rejection, as tokens per pass must,
prices a proposer that often drafts nothing below its real acceptance, and trims drafts that
pay; docs/benchmarks.md has the measurement.) The marginal gain of a sequence's (i+1)-th
draft token, prod_{j<=i} c_b[j], never grows with i, so the best plan with m draft tokens in
all takes the m largest gains across the batch; the step tries every m, so a cost curve that
is not linear is followed as measured (docs/benchmarks.md shows the curves learnt on a CPU). With one sequence this is the per-schema choice (argmax_k E(k) / cost(1 + k)).
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field
from typing import Callable, Sequence


def _bucket(n: int) -> int:
    """n up to 8 exactly; beyond, a geometric grid (~19% apart) so few buckets cover many."""
    if n <= 8:
        return max(n, 1)
    return int(round(8 * 1.1892 ** round(math.log(n / 8, 1.1892))))


@dataclass
class PassCostCurve:
    """Seconds per forward pass against the rows in it, for a given number of sequences in it,
    learnt from the passes the engine runs (exponential moving average per (sequences, rows)
    bucket). A pass costs by its rows *and* by its sequences: each sequence adds attention over
    its whole context, so 16 sequences x 1 row cost more than one sequence's 16-row draft
    (docs/benchmarks.md, part (e)); the curve for the batch at hand is used. Within it,
    cost is read linearly between measured buckets, as measured: on a CPU a pass of a few
    rows can cost more than one of more rows (matrix kernels pick their method by shape), so
    no monotonic shape is imposed. Past the last measured bucket it grows by the curve's own
    slope (`beyond_slope`), not the prior's: the prior's fixed 10 ms a row is far above what a
    row adds to a large batch's pass on a CPU or a GPU, and priced every draft past the
    measured rows out, so a batch drafted far less than it paid to (docs/benchmarks.md). A
    sequence count measured at one row count only (a batch that drafted nothing, e.g. after
    `none` jobs) has no slope of its own: it grows by the median slope of the counts measured at
    two or more (`pooled_slope`). Its own average per row would price the pass as if it had no
    fixed part, so drafts looked several times dearer than they are and the next batch took
    many more passes (docs/benchmarks.md). The prior serves a sequence count with nothing
    measured. Only decode passes are recorded: prefill chunks
    cost differently per row.

    A bucket is corrected only when the engine runs a pass of that size, so a plan that an
    overestimate rules out would never be measured again; `choose_draft_lens(explore=True)`
    (every EXPLORE_EVERY-th decode step) tries the next larger bucket to keep the curve honest."""

    prior_fixed_s: float = 0.05
    prior_row_s: float = 0.01
    alpha: float = 0.2  # weight of a new observation
    _points: dict[tuple[int, int], float] = field(default_factory=dict)

    bucket = staticmethod(_bucket)

    def observe(self, rows: int, seconds: float, seqs: int = 1) -> None:
        key = (_bucket(seqs), _bucket(rows))
        old = self._points.get(key)
        self._points[key] = seconds if old is None else (1 - self.alpha) * old + self.alpha * seconds

    def __call__(self, rows: float, seqs: int = 1) -> float:
        return self.at(seqs)(rows)

    def at(self, seqs: int) -> Callable[[float], float]:
        """Seconds per pass against its rows, for passes of `seqs` sequences: the curve read
        once, for a caller that prices many row counts (choose_draft_lens)."""
        curve = self._curve(_bucket(seqs))
        if not curve:
            return lambda rows: self.prior_fixed_s + self.prior_row_s * rows
        xs = [x for x, _ in curve]
        ys = [y for _, y in curve]
        slope = beyond_slope(xs, ys, self.pooled_slope() if len(xs) < 2 else None)

        def cost(rows: float) -> float:
            if rows <= xs[0]:
                return ys[0]
            if rows >= xs[-1]:
                return ys[-1] + slope * (rows - xs[-1])
            i = bisect.bisect_right(xs, rows)
            x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
            return y0 + (y1 - y0) * (rows - x0) / (x1 - x0)
        return cost

    def _curve(self, seqs: int) -> list[tuple[int, float]]:
        """(rows, seconds) measured with the nearest measured number of sequences, by rows."""
        counts = {b for b, _ in self._points}
        if not counts:
            return []
        near = min(counts, key=lambda b: (abs(math.log(b / seqs)), b))
        return [(rows, self._points[(near, rows)]) for rows in sorted(r for b, r in self._points if b == near)]

    def pooled_slope(self) -> float | None:
        """Seconds a row adds past the measured rows, as the sequence counts measured at two or
        more row counts say (the median of their beyond_slope); None where none is."""
        slopes = sorted(beyond_slope(list(rows), list(rows.values()))
                        for rows in self.snapshot().values() if len(rows) >= 2)
        return slopes[len(slopes) // 2] if slopes else None

    def snapshot(self, seqs: int | None = None) -> dict:
        """The raw measurements: {sequences bucket: {rows bucket: seconds}}, or with `seqs`
        {rows bucket: seconds} of the measured sequence count nearest it."""
        nested: dict[int, dict[int, float]] = {}
        for (b, r), v in sorted(self._points.items()):
            nested.setdefault(b, {})[r] = v
        if seqs is None:
            return nested
        if not nested:
            return {}
        return nested[min(nested, key=lambda b: (abs(math.log(b / seqs)), b))]


def beyond_slope(xs: Sequence[float], ys: Sequence[float], pooled: float | None = None) -> float:
    """Seconds a row past a measured curve's last point (xs rows, ys seconds, by rows): the
    secant from its first point to its last, kept between a quarter and all of the last point's
    seconds per row (a pass is a fixed part plus its rows, so a row adds at most the average;
    the floor keeps two noisy points from making rows free). One point: `pooled` (what other
    curves measured), within the same bounds, else its average."""
    avg = ys[-1] / xs[-1]
    if len(xs) < 2:
        if pooled is None:
            return avg
        slope = pooled
    else:
        slope = (ys[-1] - ys[0]) / (xs[-1] - xs[0])  # the secant
    return min(max(slope, 0.25 * avg), avg)


def expected_tokens(acceptance: Sequence[float], k: int) -> float:
    """E(k) = 1 + sum_{i<k} prod_{j<=i} c[j]; positions past the curve repeat its last value."""
    total, run = 1.0, 1.0
    for i in range(k):
        run *= acceptance[min(i, len(acceptance) - 1)] if acceptance else 0.0
        total += run
    return total


EXPLORE_EVERY = 8  # decode steps between two exploring plans (one rows bucket past the best)


def choose_draft_lens(caps: Sequence[int], acceptance: Sequence[Sequence[float] | None], base_rows: int,
                      cost: PassCostCurve, base_tokens: float | None = None, explore: bool = False,
                      prefill_rows: int = 0,
                      confidence: Sequence[Sequence[float | None] | None] | None = None) -> list[int]:
    """k per sequence. caps[b]: the most it may verify this step (the engine passes the length
    of the draft its proposer actually made); acceptance[b]: its curve, or None for a fixed-k
    sequence (gets caps[b]). base_rows: rows the pass has anyway (one per decoding sequence,
    the drafts of fixed sequences, prefill rows); base_tokens: tokens it emits anyway (one per
    decoding sequence; default len(caps)). explore: verify the best plan's draft tokens plus
    the next ones by gain up to the next rows bucket, so that bucket's cost gets measured
    (draft lengths never change what is emitted, only how fast). prefill_rows: the prefill
    chunks' rows among base_rows. They are left out of the plan: the drafts are planned as for
    a pass of the decode rows alone. A draft row beside a prefill chunk costs about what it adds
    to a decode pass (the weights are read for the step either way, and the row's arithmetic is
    the same), and an accepted token is worth what a decode pass spends per token, since it
    saves that sequence a row of a later decode pass. Pricing the plan over the whole pass
    instead makes a draft row look free beside 512 prefill rows (low-acceptance drafts were
    verified), and counting prefill rows as work done, like tokens, asks a draft to be nearly
    sure, which trimmed drafts that pay (docs/benchmarks.md compares the two). confidence[b][i]:
    how sure the proposer is of draft token i (DraftContext.confidence: a learned stretch's
    share of its voters), used for c_b[i] where given: a schema's average acceptance prices a
    unanimous stretch of earlier outputs' layout like a guess, and a guess like that stretch."""
    ks = [cap if acc is None else 0 for cap, acc in zip(caps, acceptance)]
    base_rows -= prefill_rows
    rows = base_rows + sum(ks)
    gains: list[tuple[float, int]] = []  # (marginal expected tokens, sequence)
    for b, (cap, acc) in enumerate(zip(caps, acceptance)):
        if acc is None:
            continue
        sure = confidence[b] if confidence is not None else None
        run = 1.0
        for i in range(cap):
            c = sure[i] if sure is not None and i < len(sure) else None
            run *= c if c is not None else acc[min(i, len(acc) - 1)] if acc else 0.0
            if run <= 0:
                break
            gains.append((run, b))
    gains.sort(key=lambda g: -g[0])
    expected = float(len(caps) if base_tokens is None else base_tokens)  # one token per decoding sequence
    price = cost.at(int(base_tokens if base_tokens is not None else len(caps)))
    best_m, best_rate, total = 0, expected / price(rows), expected
    for m, (gain, _) in enumerate(gains, start=1):
        total += gain
        rate = total / price(rows + m)
        if rate > best_rate * (1 + 1e-9):
            best_m, best_rate = m, rate
    if explore and best_m < len(gains):
        above = _bucket(rows + best_m) + 1  # the smallest row count in a larger bucket
        while _bucket(above) == _bucket(rows + best_m):
            above += 1
        best_m = min(len(gains), above - rows)
    for _, b in gains[:best_m]:
        ks[b] += 1
    return ks
