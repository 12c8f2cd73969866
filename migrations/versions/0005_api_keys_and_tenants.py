"""API keys, and a tenant on schemas, batches and jobs

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-22

Existing rows get the tenant "default", which is the tenant of requests made without a key
(auth off); give a key that tenant (`structspec keys create --tenant default`) to keep them.
Schema versions now count per (tenant, name).
"""

from __future__ import annotations

from typing import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0005"
down_revision: str | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

TENANT_TABLES = ("schemas", "batches", "jobs")


def upgrade() -> None:
    op.create_table(
        "api_keys",
        sa.Column("id", sa.Uuid(), nullable=False),
        sa.Column("name", sa.String(length=200), nullable=False),
        sa.Column("tenant", sa.String(length=64), nullable=False),
        sa.Column("key_hash", sa.String(length=64), nullable=False),
        sa.Column("prefix", sa.String(length=16), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("revoked_at", sa.DateTime(timezone=True), nullable=True),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_api_keys")),
        sa.UniqueConstraint("key_hash", name=op.f("uq_api_keys_key_hash")),
    )
    for table in TENANT_TABLES:
        with op.batch_alter_table(table) as batch:
            batch.add_column(sa.Column("tenant", sa.String(length=64), nullable=False, server_default="default"))
    # On SQLite this rebuilds `schemas`; migrations/env.py turns foreign keys off meanwhile, so
    # dropping the old copy does not cascade to (or fail on) the rows that reference it.
    with op.batch_alter_table("schemas") as batch:
        batch.drop_constraint("uq_schemas_name_version", type_="unique")
        batch.create_unique_constraint(op.f("uq_schemas_tenant_name_version"), ["tenant", "name", "version"])
        batch.drop_index("ix_schemas_name_hash")
        batch.create_index("ix_schemas_tenant_name_hash", ["tenant", "name", "hash"])


def downgrade() -> None:
    # Names were unique per tenant; without tenants two tenants' "invoice" v1 would collide.
    clash = op.get_bind().execute(sa.text(
        "SELECT name, version FROM schemas GROUP BY name, version HAVING count(*) > 1 LIMIT 1")).first()
    if clash is not None:
        raise RuntimeError(f"cannot downgrade: several tenants have version {clash[1]} of schema {clash[0]!r}")
    with op.batch_alter_table("schemas") as batch:
        batch.drop_index("ix_schemas_tenant_name_hash")
        batch.create_index("ix_schemas_name_hash", ["name", "hash"])
        batch.drop_constraint("uq_schemas_tenant_name_version", type_="unique")
        batch.create_unique_constraint(op.f("uq_schemas_name_version"), ["name", "version"])
    for table in reversed(TENANT_TABLES):
        with op.batch_alter_table(table) as batch:
            batch.drop_column("tenant")
    op.drop_table("api_keys")
