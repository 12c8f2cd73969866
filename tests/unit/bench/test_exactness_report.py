"""What an exactness check records where an output diverges: the reference's top-2 masked logit
gap, its top masked logit, and the gap in bf16 steps of that logit (bench/exactness.py,
the GPU kit's report)."""

from __future__ import annotations

import math

import pytest
import torch

from bench.exactness import Divergence, bf16_steps, compare
from bench.gpu import largest_gap, report_markdown
from structspec.engine.step import margins


def packed_mask(allowed: list[list[int]], vocab: int) -> torch.Tensor:
    words = torch.zeros(len(allowed), (vocab + 31) // 32, dtype=torch.int64)
    for r, tokens in enumerate(allowed):
        for t in tokens:
            words[r, t // 32] |= 1 << (t % 32)
    return torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32)


def test_margins_give_each_rows_masked_gap_and_top_logit():
    logits = torch.tensor([[9.0, 1.0, 7.5, 40.0, 0.0], [-3.0, -2.0, 5.0, 6.0, -1.0], [1.0, 2.0, 3.0, 4.0, 5.0]])
    mask = packed_mask([[0, 1, 2], [0, 1, 4], [2]], 5)  # row 0 excludes token 3's 40.0
    gaps, tops = margins(logits, mask, 0, 3)
    assert gaps[:2] == [1.5, 1.0] and math.isinf(gaps[2])  # one allowed token: no second
    assert tops == [9.0, -1.0, 3.0]
    assert margins(logits, mask, 1, 1) == ([1.0], [-1.0])


def test_bf16_steps_measure_a_gap_by_the_spacing_at_the_logits_size():
    assert bf16_steps(0.125, 20.0) == 1.0  # 16 <= 20 < 32: spacing 2^(4-7)
    assert bf16_steps(0.0625, -17.0) == 0.5
    assert bf16_steps(0.039, 1.5) == pytest.approx(0.039 / 2 ** -7)
    assert bf16_steps(math.inf, 3.0) == math.inf and bf16_steps(0.0, 0.0) == 0.0


class Result:
    def __init__(self, tokens, margins=None, tops=None):
        self.tokens, self.margins, self.tops = tokens, margins, tops


def test_a_divergence_carries_the_references_gap_and_top_logit():
    ref = Result([5, 6, 7], margins=[3.0, 0.02, 1.0], tops=[12.0, 18.5, 11.0])
    assert compare(ref, Result([5, 6, 7])) is None
    assert compare(ref, Result([5, 9, 7])) == Divergence(1, 0.02, 18.5)
    assert compare(Result([5, 6]), Result([5, 6, 1])) == Divergence(2, None, None)  # no trace, a longer output


def test_the_reports_exactness_table_shows_the_largest_gap_in_bf16_steps():
    run = {"config": "qwen", "dtype": "bf16", "documents": 12, "identical": 10, "accepted_draft_tokens": 300,
           "diverged": [{"index": 4, "gap": 0.039, "top": 21.0}, {"index": 9, "gap": 0.01, "top": 2.0},
                        {"index": 30, "gap": None, "top": None}]}
    assert largest_gap(run["diverged"]) == {"largest gap at a divergence": 0.039, "its top logit": 21.0,
                                            "in bf16 steps": round(0.039 / 0.125, 2)}
    old = [{"index": 4, "gap": 0.016}]  # a report from before the top was recorded
    assert largest_gap(old)["in bf16 steps"] is None and largest_gap([])["largest gap at a divergence"] is None
    md = report_markdown("cpu", {"exactness": {"ok": True, "seconds": 1.0, "runs": [run]}})
    assert "| in bf16 steps |" in md and "| 0.31 |" in md
