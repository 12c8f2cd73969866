"""Comparing an output with the one-at-a-time `none` reference, as the exactness tests do and
as the GPU check reports it.

Batched, multi-row and speculative passes round differently in the last bits, so an output
may differ from the reference only where the reference's two best masked logits were within
a small epsilon (a near-tie): `compare` says which of the three cases an output is.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


def first_divergence(reference: list[int], got: list[int]) -> int | None:
    """The first index where the two token lists differ (a length difference counts), or None."""
    for j, (a, b) in enumerate(zip(reference, got)):
        if a != b:
            return j
    return None if len(reference) == len(got) else min(len(reference), len(got))


@dataclass(frozen=True)
class Divergence:
    """Where `got` first differs from the reference: output index, the reference's top-2
    masked logit gap there (None when the reference has no margin for that row: it ended by EOS)
    and its top masked logit (a bf16 rounding of a logit is relative to its size)."""

    index: int
    gap: float | None
    top: float | None = None

    def near_tie(self, eps: float) -> bool:
        return self.gap is not None and self.gap < eps


def bf16_steps(gap: float, top: float) -> float:
    """`gap` in units of bf16's spacing at the size of `top` (2^(e-7) for |top| in [2^e, 2^(e+1))):
    one rounding of a bf16 logit that size moves it by up to half a unit, so a gap of a unit or
    two is a tie the dtype cannot separate, whatever the logit's scale."""
    if top == 0 or not math.isfinite(top) or not math.isfinite(gap):
        return math.inf if gap else 0.0
    return gap / 2.0 ** (math.floor(math.log2(abs(top))) - 7)


def compare(reference, got) -> Divergence | None:
    """None if `got` (an ExtractResult) has the reference's tokens; else where it diverges.
    The reference must have been run with Request(trace=True), which records its margins."""
    j = first_divergence(reference.tokens, got.tokens)
    if j is None:
        return None
    gap = reference.margins[j] if reference.margins is not None and j < len(reference.margins) else None
    top = reference.tops[j] if reference.tops is not None and j < len(reference.tops) else None
    return Divergence(j, gap, top)


def bounded(node, max_items: int = 2):
    """`node` (a JSON Schema) with maxItems on every array and every number a bounded integer:
    random and small models repeat array items and digits until max_tokens; bounded, they finish."""
    if isinstance(node, list):
        return [bounded(v, max_items) for v in node]
    if not isinstance(node, dict):
        return node
    out = {k: bounded(v, max_items) for k, v in node.items()}
    if node.get("type") == "array":
        out["maxItems"] = max_items
    if node.get("type") in ("number", "integer"):  # a range bounds an integer's digits, not a fraction's
        out.update(type="integer", minimum=-99999, maximum=99999)
    return out
