"""Run Alembic migrations programmatically (`structspec migrate`, `structspec serve`, tests)."""

from __future__ import annotations

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory

from structspec.db.session import make_engine
from structspec.layout import checkout, data_dir


def alembic_config(database_url: str) -> Config:
    """An Alembic config for the package's migrations (the installed package's, or a checkout's
    migrations/), bound to `database_url`.

    The URL goes through `config.attributes`, not `sqlalchemy.url`: the ini parser would
    treat a `%` in a percent-encoded password as interpolation. A checkout's alembic.ini (for
    `alembic revision` there: the file names' template) is read where there is one; a wheel has
    none and needs none.
    """
    root = checkout()
    ini = root / "alembic.ini" if root is not None else None
    cfg = Config(str(ini)) if ini is not None and ini.is_file() else Config()
    cfg.set_main_option("script_location", str(data_dir("migrations")))
    cfg.attributes["database_url"] = database_url
    cfg.attributes["configure_logging"] = False  # keep the host process's logging (uvicorn, pytest)
    return cfg


def upgrade(database_url: str, revision: str = "head") -> None:
    command.upgrade(alembic_config(database_url), revision)


def downgrade(database_url: str, revision: str) -> None:
    command.downgrade(alembic_config(database_url), revision)


def head_revision() -> str | None:
    return ScriptDirectory.from_config(alembic_config("")).get_current_head()


def current_revision(database_url: str) -> str | None:
    engine = make_engine(database_url)
    try:
        with engine.connect() as conn:
            return MigrationContext.configure(conn).get_current_revision()
    finally:
        engine.dispose()
