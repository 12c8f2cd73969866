"""API keys: create, list, revoke, and find a key's tenant.

A key is `ss_` + 43 random URL-safe characters, shown once when it is created; only its
SHA-256 is stored. `structspec keys` manages them; the API's middleware (structspec/api/auth.py)
turns a request's key into its tenant.
"""

from __future__ import annotations

import hashlib
import re
import secrets
import uuid

from sqlalchemy.orm import Session, sessionmaker

from structspec.config import Settings
from structspec.db.models import ApiKeyRecord
from structspec.db.repositories import ApiKeyRepository

KEY_PREFIX = "ss_"
TENANT_NAME = re.compile(r"[A-Za-z0-9._-]{1,64}")


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode("utf-8")).hexdigest()


def bearer_key(authorization: str) -> str | None:
    """The key an `Authorization` header value carries, as auth looks it up: `Bearer <key>`,
    the scheme in any case, white space around either part stripped. None: not that form."""
    scheme, _, key = authorization.strip().partition(" ")
    key = key.strip()
    return key if scheme.lower() == "bearer" and key else None


def create_key(session_factory: sessionmaker[Session], name: str, tenant: str) -> tuple[ApiKeyRecord, str]:
    """A new key for `tenant`: (its record, the key itself, which is not stored). ValueError
    naming the problem for an invalid tenant or name."""
    if not TENANT_NAME.fullmatch(tenant):
        raise ValueError(f"invalid tenant {tenant!r}: 1-64 characters from A-Z a-z 0-9 . _ -")
    if not name.strip() or len(name) > 200:
        raise ValueError("a key's name must be 1-200 characters")
    key = KEY_PREFIX + secrets.token_urlsafe(32)
    with session_factory.begin() as session:
        record = ApiKeyRepository(session).add(name=name, tenant=tenant, key_hash=hash_key(key),
                                               prefix=key[:len(KEY_PREFIX) + 6])
        session.expunge(record)
    return record, key


def list_keys(session_factory: sessionmaker[Session]) -> list[ApiKeyRecord]:
    """Every key, revoked ones included, oldest first."""
    with session_factory() as session:
        records = list(ApiKeyRepository(session).list())
        session.expunge_all()
    return records


def revoke_key(session_factory: sessionmaker[Session], key_id: str) -> ApiKeyRecord | None:
    """The revoked key's record; None when no key has that id."""
    try:
        kid = uuid.UUID(key_id)
    except ValueError:
        return None
    with session_factory.begin() as session:
        record = ApiKeyRepository(session).revoke(kid)
        if record is not None:
            session.expunge(record)
        return record


def auth_required(session_factory: sessionmaker[Session], settings: Settings) -> bool:
    """Auth is on once one unrevoked key exists, or always with STRUCTSPEC_REQUIRE_AUTH."""
    if settings.require_auth:
        return True
    with session_factory() as session:
        return ApiKeyRepository(session).any_active()


def tenant_of(session_factory: sessionmaker[Session], key: str) -> str | None:
    """The tenant of an unrevoked key; None for an unknown or revoked one."""
    with session_factory() as session:
        record = ApiKeyRepository(session).active_by_hash(hash_key(key))
        return None if record is None else record.tenant
