"""ArmAggregate: reached_by_position and batch size fold in exactly and decayed, and stats
from before those keys derive them as if every pass was offered its full draft_len."""

from __future__ import annotations

import pytest

from structspec.stats.aggregate import ArmAggregate, InMemoryStats, job_reached


def job(passes: int, acc: list[int], prop: list[int], k: int = 4, **extra) -> dict:
    return {"strategy": "ngram", "draft_len": k, "output_tokens": passes + sum(acc), "target_passes": passes,
            "proposed": sum(prop), "accepted": sum(acc), "decode_s": 0.1, "accepted_by_position": acc,
            "proposed_by_position": prop, **extra}


def test_reached_and_batch_size_fold_in_exact_and_decayed_like_accepted():
    arm = ArmAggregate("ngram", 4)
    arm.add(job(10, [6, 3, 1, 0], [10, 8, 8, 8], reached_by_position=[10, 5, 3, 1], batch_size=6.5), 0, 10)
    arm.add(job(4, [2, 1], [4, 2], reached_by_position=[4, 2, 1], batch_size=1.5), 11, 10)
    assert arm.reached_by_position == [14, 7, 4, 1]
    assert arm.accepted_by_position == [8, 4, 1, 0] and arm.proposed_by_position == [14, 10, 8, 8]
    assert arm.batch_size_sum == 8.0 and arm.requests == 2
    # the first job is one half-life older: its counts weigh half, like d_accepted's
    assert arm.d_reached_by_position == pytest.approx([9, 4.5, 2.5, 0.5])
    assert arm.d_accepted_by_position == pytest.approx([5, 2.5, 0.5, 0])
    view = arm.decayed(22, 10)  # ten more requests of the schema: everything halves again
    assert view.reached_by_position == pytest.approx([4.5, 2.25, 1.25, 0.25])
    assert view.passes == pytest.approx(4.5)


def test_stats_without_reached_derive_it_as_if_offered_the_full_draft_len():
    # full drafts: reached[0] = passes, reached[i] = accepted[i-1]
    assert job_reached(job(10, [6, 3, 1, 0], [10] * 4), 4) == [10, 6, 3, 1]
    # the grammar cut every draft to 2: position 2 was still offered (k = 4) whenever 0..1 were
    # accepted, a rejection in tokens-per-pass terms; position 3 was never reached
    assert job_reached(job(10, [6, 3], [10, 10]), 4) == [10, 6, 3]
    assert job_reached(job(10, [6, 0], [10, 10]), 4) == [10, 6]  # nothing reached position 2
    assert job_reached(job(10, [6, 3], [10, 10]), 2) == [10, 6]  # k = 2 offers no position 2
    assert job_reached(job(3, [], []), 4) == [3]  # drafts always empty: position 0 still offered
    assert job_reached(job(0, [], []), 4) == []
    assert job_reached(job(5, [], [], k=0), 0) == []  # `none` offers nothing
    assert job_reached(job(10, [6, 3], [10, 10], reached_by_position=[7, 2, 1]), 4) == [7, 2, 1]


def test_a_job_without_batch_size_counts_as_decoded_alone():
    stats = InMemoryStats(0)
    stats.record(job(10, [6, 3], [10, 10]))
    stats.record(job(10, [6, 3], [10, 10], batch_size=3.0))
    [arm] = stats.arms.values()
    assert arm.batch_size_sum == 4.0
    # the derived reached adds a stored position (2) that nothing was drafted at
    assert arm.reached_by_position == [20, 12, 6] and arm.proposed_by_position == [20, 20, 0]
    assert arm.decayed(2, 0).drafted_by_position == [1.0, 1.0]  # shares of drafted positions only
