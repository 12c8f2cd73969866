"""Column types that behave the same on SQLite and PostgreSQL."""

from __future__ import annotations

from datetime import datetime, timezone

import sqlalchemy as sa
from sqlalchemy.types import TypeDecorator


class UTCDateTime(TypeDecorator):
    """Timezone-aware UTC datetimes in and out.

    PostgreSQL stores `timestamptz`; SQLite has no time zones and hands back naive values,
    so values are normalised to UTC on the way in and tagged UTC on the way out.
    """

    impl = sa.DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError("naive datetime; use datetime.now(timezone.utc)")
        return value.astimezone(timezone.utc)

    def process_result_value(self, value: datetime | None, dialect) -> datetime | None:
        if value is None:
            return None
        return value.replace(tzinfo=timezone.utc) if value.tzinfo is None else value.astimezone(timezone.utc)


def utcnow() -> datetime:
    return datetime.now(timezone.utc)


def database_now(session) -> datetime:
    """The database's clock (UTC), so leases and queue times agree across worker and API hosts
    whose clocks differ. PostgreSQL: its now() (the transaction's start). SQLite is a local
    file with no server: this host's clock is the database's."""
    if session.get_bind().dialect.name == "sqlite":
        return utcnow()
    return session.scalar(sa.select(sa.func.now())).astimezone(timezone.utc)
