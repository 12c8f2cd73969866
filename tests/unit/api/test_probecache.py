"""The cache behind /health and /metrics (structspec/api/services/probecache.py)."""

from __future__ import annotations

import sys
import threading
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from structspec.api.services.probecache import ProbeCache  # noqa: E402


class Clock:
    def __init__(self) -> None:
        self.now = 10.0

    def __call__(self) -> float:
        return self.now


def test_concurrent_callers_share_one_read():
    """While one read runs, the other callers wait for it and get its answer: eight probes
    arriving together cost one read."""
    cache, started, release, reads, answers = ProbeCache(clock=Clock()), threading.Event(), threading.Event(), [], []

    def read():
        reads.append(1)
        started.set()
        assert release.wait(60)  # a generous bound: only a hung test waits that long
        return "report"

    first = threading.Thread(target=lambda: answers.append(cache.get("k", read)))
    first.start()
    assert started.wait(60)
    others = [threading.Thread(target=lambda: answers.append(cache.get("k", read))) for _ in range(7)]
    for t in others:
        t.start()
    release.set()
    for t in [first, *others]:
        t.join(60)
    assert answers == ["report"] * 8 and len(reads) == 1


def test_an_answer_expires_after_ttl_and_a_failure_is_cached_too():
    clock = Clock()
    cache, reads = ProbeCache(ttl_s=1.0, clock=clock), []

    def failing():
        reads.append(1)
        raise ConnectionError("database down")

    for _ in range(3):
        with pytest.raises(ConnectionError):
            cache.get("k", failing)
    assert len(reads) == 1
    clock.now += 1.0
    assert cache.get("k", lambda: "back") == "back" and cache.get("k", failing) == "back"
    assert cache.get("other", lambda: "own key") == "own key"
