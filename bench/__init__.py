"""The development harness beside the product: benchmarks, peers, the GPU kit, kernel
microbenchmarks and reports (`python -m bench.<name>` from the repository's root; `make bench*`).

It imports structspec, never the reverse (tests/unit/test_layering.py), and is not in the wheel:
run it from a checkout. Each module states its command; figures go to docs/benchmarks.md and
docs/conformance.md.
Shared here: `percentile`, the one definition every report's pNN uses.
"""

from __future__ import annotations

import math


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile (0-100) with linear interpolation between closest ranks (numpy's
    default); None for no values."""
    if not values:
        return None
    if not 0 <= q <= 100:
        raise ValueError(f"percentile {q} is outside 0-100")
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)
