"""`strategy: auto` outside the service: `structspec extract` learns in the local database.

The CLI registers its schema file in the same registry the API uses (name `cli.<file stem>`,
deduplicated by content), picks (strategy, draft_len) per document exactly as a worker does,
and folds each document's stats into the same tables, so `GET /v1/schemas/{id}/stats` of a
server on that database shows what the CLI learned.
"""

from __future__ import annotations

import uuid
from typing import Any

from structspec.config import Settings
from structspec.db import migrate
from structspec.db.session import make_engine, make_session_factory
from structspec.db.stats import StatsRepository
from structspec.services.schemas import SchemaRegistry
from structspec.services.strategy import InFlight, acceptance_curve, choose_for_job
from structspec.stats.selector import Choice


class LocalStats:
    """The selector and statistics of one schema in `settings.database_url` (migrated first)."""

    def __init__(self, settings: Settings, schema: dict[str, Any], name: str):
        self.settings = settings
        migrate.upgrade(settings.database_url)
        self.sessions = make_session_factory(make_engine(settings.database_url))
        registered, _ = SchemaRegistry(self.sessions, settings).register(
            name, schema, "registered by structspec extract")
        self.schema_id: uuid.UUID = registered.id
        self.name = f"{registered.name} v{registered.version}"
        self.in_flight = InFlight()

    def choose(self, draft_len: int | None = None, verbatim: bool = False) -> tuple[Choice, str]:
        """A Thompson draw (or the schema's pin), as the worker makes it for a job; the choice
        counts as pending until `record` gets its stats."""
        with self.sessions() as session:
            choice, why = choose_for_job(session, self.settings, self.schema_id, job_id=uuid.uuid4(),
                                         draft_len=draft_len, verbatim=verbatim,
                                         pending=self.in_flight.pending(self.schema_id, verbatim))
        self.in_flight.begin(self.schema_id, verbatim, choice.strategy)
        return choice, why

    def acceptance(self, strategy: str, n: int, verbatim: bool = False) -> list[float]:
        """A Thompson draw of the schema's acceptance of `strategy` at draft positions 0..n-1,
        as the worker passes it (the engine trims drafts by it when they do not pay)."""
        with self.sessions() as session:
            return acceptance_curve(session, self.settings, self.schema_id, strategy, n, verbatim=verbatim,
                                    job_id=uuid.uuid4())

    def record(self, stats: dict[str, Any], latency_s: float) -> None:
        """Store one document's stats (and end its pending choice)."""
        self.in_flight.end(self.schema_id, bool(stats.get("verbatim")), stats["strategy"])
        with self.sessions.begin() as session:
            StatsRepository(session).record(self.schema_id, stats, half_life=self.settings.stats_half_life,
                                            latency_s=latency_s)
