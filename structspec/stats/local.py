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
from structspec.stats.selector import Choice


def cli_schema_name(path: str) -> str:
    """`cli.` + the registry name the client commands give the same file."""
    from structspec.client import schema_name

    return ("cli." + schema_name(path))[:200]


class LocalStats:
    """The selector and statistics of one schema in `settings.database_url` (migrated first)."""

    def __init__(self, settings: Settings, schema: dict[str, Any], name: str):
        from structspec.api.services.schemas import SchemaService
        from structspec.api.structs import SchemaCreate
        from structspec.db import migrate
        from structspec.db.session import make_engine, make_session_factory

        self.settings = settings
        migrate.upgrade(settings.database_url)
        self.sessions = make_session_factory(make_engine(settings.database_url))
        registered, _ = SchemaService(self.sessions, settings).register(
            SchemaCreate(name=name, schema=schema, description="registered by structspec extract"))
        self.schema_id: uuid.UUID = registered.id
        self.name = f"{registered.name} v{registered.version}"

    def choose(self, draft_len: int | None = None, verbatim: bool = False) -> tuple[Choice, str]:
        """A Thompson draw (or the schema's pin), as the worker makes it for a job."""
        from structspec.stats.resolve import choose

        with self.sessions() as session:
            return choose(session, self.settings, self.schema_id, job_id=uuid.uuid4(), draft_len=draft_len,
                          verbatim=verbatim)

    def record(self, stats: dict[str, Any], latency_s: float) -> None:
        from structspec.db.stats import StatsRepository

        with self.sessions.begin() as session:
            StatsRepository(session).record(self.schema_id, stats, half_life=self.settings.stats_half_life,
                                            latency_s=latency_s)
