"""Storage: SQLAlchemy 2.0 models, engine/session factory, repositories (sync; the API runs
them in worker threads). Schema changes go through Alembic revisions in migrations/."""

from structspec.db.models import Base, SchemaRecord
from structspec.db.repositories import SchemaRepository
from structspec.db.session import make_engine, make_session_factory, normalize_database_url

__all__ = ["Base", "SchemaRecord", "SchemaRepository", "make_engine", "make_session_factory",
           "normalize_database_url"]
