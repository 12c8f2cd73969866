"""Alembic environment: the database URL comes from, in order, the caller
(`config.attributes["database_url"]`, set by structspec.db.migrate), `sqlalchemy.url` in the
config, or Settings.from_env() (STRUCTSPEC_DATABASE_URL / STRUCTSPEC_DATA_DIR)."""

from __future__ import annotations

from logging.config import fileConfig

from alembic import context

from structspec.config import Settings
from structspec.db.models import Base
from structspec.db.session import make_engine, normalize_database_url

config = context.config

if config.config_file_name is not None and config.attributes.get("configure_logging", True):
    fileConfig(config.config_file_name, disable_existing_loggers=False)

target_metadata = Base.metadata


def database_url() -> str:
    url = config.attributes.get("database_url") or config.get_main_option("sqlalchemy.url")
    return normalize_database_url(url or Settings.from_env().database_url)


def run_migrations_offline() -> None:
    """`alembic upgrade --sql`: emit SQL without connecting."""
    context.configure(url=database_url(), target_metadata=target_metadata, literal_binds=True,
                      render_as_batch=True, dialect_opts={"paramstyle": "named"})
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    connection = config.attributes.get("connection")
    if connection is not None:  # a caller-owned connection (e.g. inside a test transaction)
        _run(connection)
        return
    engine = make_engine(database_url())
    try:
        with engine.connect() as conn:
            _run(conn)
    finally:
        engine.dispose()


def _run(connection) -> None:
    # render_as_batch: SQLite cannot ALTER most things; batch mode copies the table instead.
    context.configure(connection=connection, target_metadata=target_metadata, render_as_batch=True,
                      compare_type=True)
    # A batch copy drops the original table, and with foreign keys on, SQLite's DROP first
    # deletes its rows, cascading to (or failing on) the rows that reference them. The pragma
    # only takes effect outside a transaction: a caller-owned connection inside one keeps it.
    sqlite = connection.dialect.name == "sqlite" and not connection.in_transaction()
    if sqlite:
        connection.exec_driver_sql("PRAGMA foreign_keys=OFF")
    try:
        with context.begin_transaction():
            context.run_migrations()
    finally:
        if sqlite:
            connection.exec_driver_sql("PRAGMA foreign_keys=ON")


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
