"""Turn a job's `strategy: auto` into a concrete (strategy, draft_len) before the engine runs."""

from __future__ import annotations

import random
import uuid
from typing import Any

from sqlalchemy.orm import Session

from structspec.config import Settings
from structspec.stats.aggregate import mode_views
from structspec.stats.selector import Choice, Selector, SelectorConfig

AUTO = "auto"


def selector_config(settings: Settings) -> SelectorConfig:
    lens = tuple(sorted({int(x) for x in settings.stats_draft_lens.split(",") if x.strip()}))
    return SelectorConfig(draft_lens=lens or SelectorConfig.draft_lens,
                          prior_pass_s=settings.stats_prior_pass_ms / 1000.0)


def choose(session: Session, settings: Settings, schema_id: uuid.UUID, *, job_id: uuid.UUID | None = None,
           draft_len: int | None = None, verbatim: bool = False) -> tuple[Choice, str]:
    """(choice, why) for a job of `schema_id`: the schema's pin if set ("pinned"), else a
    Thompson draw seeded by (stats_seed, job_id) ("selected"); job_id None gives the
    posterior-mean choice ("estimate"). Verbatim jobs learn only from verbatim jobs."""
    from structspec.db.stats import StatsRepository

    repo = StatsRepository(session)
    pin = repo.pin(schema_id)
    if pin is not None:
        return Choice(pin.strategy, pin.draft_len), "pinned"
    views = mode_views(repo.views(schema_id, settings.stats_half_life), verbatim)
    rng = random.Random(f"{settings.stats_seed}:{job_id}") if job_id is not None else None
    choice = Selector(selector_config(settings)).choose(views, rng, draft_len=draft_len)
    return choice, "selected" if rng is not None else "estimate"


def resolve_options(session: Session, settings: Settings, schema_id: uuid.UUID, job_id: uuid.UUID,
                    options: dict[str, Any], verbatim: bool = False) -> dict[str, Any]:
    """`options` with strategy/draft_len concrete. With auto and a given draft_len, only the
    strategy is chosen (at that k; the schema's pin still wins)."""
    if options.get("strategy") != AUTO:
        return options
    choice, _ = choose(session, settings, schema_id, job_id=job_id, draft_len=options.get("draft_len"),
                       verbatim=verbatim)
    return {**options, "strategy": choice.strategy, "draft_len": choice.draft_len}
