"""Engine and session factory from a database URL (SQLite file or PostgreSQL)."""

from __future__ import annotations

from pathlib import Path

import sqlalchemy as sa
from sqlalchemy.engine import Engine, make_url
from sqlalchemy.orm import Session, sessionmaker


def normalize_database_url(url: str) -> str:
    """Pick the installed driver: psycopg 3 for PostgreSQL (SQLAlchemy's default for a bare
    `postgresql://` is psycopg2, which is not a dependency). `postgres://` is accepted too."""
    if url.startswith("postgres://"):
        url = "postgresql://" + url[len("postgres://"):]
    if url.startswith("postgresql://"):
        url = "postgresql+psycopg://" + url[len("postgresql://"):]
    return url


def sqlite_path(url: str) -> Path | None:
    """The file behind a SQLite URL (`sqlite:///...` or kombu's `sqla+sqlite:///...`), or None
    for other databases and in-memory SQLite."""
    if url.startswith("sqla+"):
        url = url[len("sqla+"):]
    if not url.startswith("sqlite"):
        return None
    database = make_url(url).database
    if not database or database == ":memory:" or database.startswith("file:"):
        return None
    return Path(database)


def ensure_sqlite_dir(url: str) -> None:
    """SQLite creates the file but not its directory; create the directory."""
    path = sqlite_path(url)
    if path is not None:
        path.expanduser().parent.mkdir(parents=True, exist_ok=True)


def make_engine(url: str, *, echo: bool = False) -> Engine:
    """hide_parameters: a database error's message (logged with its traceback) must not carry
    the bound values, which include whole documents and results."""
    url = normalize_database_url(url)
    ensure_sqlite_dir(url)
    if url.startswith("sqlite"):
        # Threads share the pool (the API runs handlers in a thread pool); wait up to 30 s
        # for another writer (the worker process) instead of failing with "database is locked".
        engine = sa.create_engine(url, echo=echo, hide_parameters=True,
                                  connect_args={"check_same_thread": False, "timeout": 30})
        sa.event.listen(engine, "connect", _sqlite_pragmas)
        return engine
    connect_args = {"connect_timeout": 5} if url.startswith("postgresql") else {}
    return sa.create_engine(url, echo=echo, pool_pre_ping=True, hide_parameters=True, connect_args=connect_args)


def _sqlite_pragmas(dbapi_connection, _record) -> None:
    cur = dbapi_connection.cursor()
    cur.execute("PRAGMA foreign_keys=ON")
    # WAL: readers do not block the writer, which matters once API and worker share the file.
    cur.execute("PRAGMA journal_mode=WAL")
    cur.execute("PRAGMA busy_timeout=30000")
    cur.close()


def make_session_factory(engine: Engine) -> sessionmaker[Session]:
    # expire_on_commit=False: records are turned into response structs after the commit.
    return sessionmaker(bind=engine, expire_on_commit=False)
