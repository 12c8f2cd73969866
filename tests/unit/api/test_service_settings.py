"""Service settings: environment parsing, derived URLs, database URL normalisation."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from structspec.config import Settings  # noqa: E402
from structspec.db.session import normalize_database_url, sqlite_path  # noqa: E402


def test_urls_default_to_sqlite_files_in_data_dir():
    s = Settings.from_env({"STRUCTSPEC_DATA_DIR": "/srv/ss"})
    assert s.database_url == "sqlite:////srv/ss/structspec.db"
    assert s.broker_url == "sqla+sqlite:////srv/ss/broker.db"


def test_service_fields_come_from_the_environment():
    s = Settings.from_env({"STRUCTSPEC_DATABASE_URL": "postgresql://u@db/structspec",
                           "STRUCTSPEC_BROKER_URL": "redis://cache:6379/0", "STRUCTSPEC_PORT": "9001",
                           "STRUCTSPEC_HOST": "0.0.0.0", "STRUCTSPEC_MAX_BODY_BYTES": "1000",
                           "STRUCTSPEC_MAX_SCHEMA_BYTES": "100", "STRUCTSPEC_MAX_DOCUMENT_BYTES": "10",
                           "STRUCTSPEC_MAX_BATCH_SIZE": "5"})
    assert (s.database_url, s.broker_url, s.host, s.port) == \
        ("postgresql://u@db/structspec", "redis://cache:6379/0", "0.0.0.0", 9001)
    assert (s.max_body_bytes, s.max_schema_bytes, s.max_document_bytes, s.max_batch_size) == (1000, 100, 10, 5)


def test_defaults():
    s = Settings.from_env({})
    assert (s.host, s.port) == ("127.0.0.1", 8000)
    assert (s.max_body_bytes, s.max_schema_bytes, s.max_document_bytes, s.max_batch_size) == \
        (8 * 2**20, 256 * 2**10, 2**20, 10_000)


def test_ensure_data_dir_creates_it(tmp_path):
    s = Settings(data_dir=tmp_path / "a" / "b")
    assert s.ensure_data_dir().is_dir()


def test_postgres_urls_get_the_psycopg_driver():
    assert normalize_database_url("postgresql://u@h/d") == "postgresql+psycopg://u@h/d"
    assert normalize_database_url("postgres://u@h/d") == "postgresql+psycopg://u@h/d"
    assert normalize_database_url("postgresql+psycopg://u@h/d") == "postgresql+psycopg://u@h/d"
    assert normalize_database_url("sqlite:///x.db") == "sqlite:///x.db"


def test_sqlite_path_of_database_and_broker_urls():
    assert sqlite_path("sqlite:////srv/x.db") == Path("/srv/x.db")
    assert sqlite_path("sqla+sqlite:////srv/b.db") == Path("/srv/b.db")
    assert sqlite_path("sqlite://") is None
    assert sqlite_path("redis://h/0") is None


def test_limit_settings_come_from_the_environment_with_documented_defaults():
    d = Settings.from_env({})
    assert (d.max_schema_depth, d.max_schema_nodes, d.rate_limit_per_minute, d.rate_limit_burst,
            d.grammar_max_size, d.grammar_initial_lexer_fuel, d.grammar_compile_timeout_s,
            d.document_token_check) == (32, 10_000, 600, 100, 500_000, 1_000_000, 10, "auto")
    s = Settings.from_env({"STRUCTSPEC_MAX_SCHEMA_DEPTH": "8", "STRUCTSPEC_RATE_LIMIT_PER_MINUTE": "0",
                           "STRUCTSPEC_GRAMMAR_MAX_SIZE": "1000", "STRUCTSPEC_DOCUMENT_TOKEN_CHECK": "off"})
    assert (s.max_schema_depth, s.rate_limit_per_minute, s.grammar_max_size, s.document_token_check) == \
        (8, 0, 1000, "off")


def test_job_retention_defaults_to_keeping_and_refuses_a_negative_count():
    import pytest

    from structspec.config import SettingsError

    assert Settings.from_env({}).job_retention_days == 0
    assert Settings.from_env({"STRUCTSPEC_JOB_RETENTION_DAYS": "30"}).job_retention_days == 30
    with pytest.raises(SettingsError, match="STRUCTSPEC_JOB_RETENTION_DAYS must be 0"):
        Settings.from_env({"STRUCTSPEC_JOB_RETENTION_DAYS": "-1"})
