"""Turn a job's `strategy: auto` into a concrete (strategy, draft_len) before the engine runs.

The statistics are read through db/stats.py and judged by the pure selector in stats/; the
worker, the CLI (services/local.py) and GET /v1/schemas/{id}/stats all choose through here."""

from __future__ import annotations

import random
import threading
import uuid
from collections import Counter
from typing import Mapping

from sqlalchemy.orm import Session

from structspec.config import Settings
from structspec.db.stats import StatsRepository
from structspec.options import AUTO, RequestOptions
from structspec.stats.aggregate import mode_views
from structspec.stats.selector import PROPOSING, Choice, Selector, SelectorConfig


def selector_config(settings: Settings) -> SelectorConfig:
    lens = tuple(sorted({int(x) for x in settings.stats_draft_lens.split(",") if x.strip()}))
    # without the suffix proposer's memory (engine_suffix_mb 0) `suffix` drafts nothing: never chosen
    strategies = tuple(s for s in PROPOSING if s != "suffix" or settings.engine_suffix_mb > 0)
    return SelectorConfig(strategies=strategies, draft_lens=lens or SelectorConfig.draft_lens,
                          prior_pass_s=settings.stats_prior_pass_ms / 1000.0)


def choose_for_job(session: Session, settings: Settings, schema_id: uuid.UUID, *,
                   job_id: uuid.UUID | None = None, draft_len: int | None = None, verbatim: bool = False,
                   pending: Mapping[str, float] | None = None) -> tuple[Choice, str]:
    """(choice, why) for a job of `schema_id`: the schema's pin if set ("pinned"), else a
    Thompson draw seeded by (stats_seed, job_id) ("selected"); job_id None gives the
    posterior-mean choice ("estimate"). Verbatim jobs learn only from verbatim jobs."""
    repo = StatsRepository(session)
    pin = repo.pin(schema_id)
    if pin is not None:
        return Choice(pin.strategy, pin.draft_len), "pinned"
    views = mode_views(repo.views(schema_id, settings.stats_half_life), verbatim)
    rng = random.Random(f"{settings.stats_seed}:{job_id}") if job_id is not None else None
    choice = Selector(selector_config(settings)).choose(views, rng, draft_len=draft_len, pending=pending)
    return choice, "selected" if rng is not None else "estimate"


def concrete_options(session: Session, settings: Settings, schema_id: uuid.UUID, job_id: uuid.UUID,
                     options: RequestOptions, verbatim: bool = False,
                     pending: Mapping[str, float] | None = None) -> RequestOptions:
    """`options` with strategy/draft_len concrete. With auto and a given draft_len, only the
    strategy is chosen (at that k; the schema's pin still wins)."""
    if options.strategy != AUTO:
        return options
    choice, _ = choose_for_job(session, settings, schema_id, job_id=job_id, draft_len=options.draft_len,
                               verbatim=verbatim, pending=pending)
    return options.replace(strategy=choice.strategy, draft_len=choice.draft_len)


def acceptance_curve(session: Session, settings: Settings, schema_id: uuid.UUID, strategy: str, n: int,
                     verbatim: bool = False, job_id: uuid.UUID | None = None) -> list[float]:
    """c'_0..c'_{n-1}, the conditional acceptance of a drafted token of `strategy` for jobs of
    `schema_id` in the job's mode (verbatim or not; Selector.draft_acceptance), from the schema's
    statistics whether or not a pin chose the strategy (the engine trims each step's draft by
    it): a Thompson draw seeded by
    (stats_seed, job_id, "acceptance"), or the posterior mean with job_id None. With no data:
    the prior at every position."""
    views = mode_views(StatsRepository(session).views(schema_id, settings.stats_half_life), verbatim)
    rng = random.Random(f"{settings.stats_seed}:{job_id}:acceptance") if job_id is not None else None
    return Selector(selector_config(settings)).draft_acceptance(views, strategy, n, rng)


class InFlight:
    """Auto jobs whose strategy was chosen but whose stats are not recorded yet, per (schema,
    mode): a batch's jobs are chosen before any of them finishes, and a new schema's probes
    must still spread over the proposers (Selector.probe counts these as uses). Thread-safe;
    one per process (worker) or per run (CLI)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._counts: dict[tuple[uuid.UUID, bool], Counter] = {}

    def pending(self, schema_id: uuid.UUID, verbatim: bool) -> dict[str, int]:
        with self._lock:
            return dict(self._counts.get((schema_id, verbatim), {}))

    def begin(self, schema_id: uuid.UUID, verbatim: bool, strategy: str) -> None:
        with self._lock:
            self._counts.setdefault((schema_id, verbatim), Counter())[strategy] += 1

    def end(self, schema_id: uuid.UUID, verbatim: bool, strategy: str) -> None:
        with self._lock:
            counts = self._counts.get((schema_id, verbatim))
            if counts is not None:
                counts[strategy] -= 1
                if counts[strategy] <= 0:
                    del counts[strategy]
                if not counts:
                    del self._counts[(schema_id, verbatim)]
