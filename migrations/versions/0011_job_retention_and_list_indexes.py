"""indexes for listing jobs and batches and for the retention sweep

Revision ID: 0011
Revises: 0010
Create Date: 2026-11-24

GET /v1/extractions and GET /v1/batches page a tenant's rows newest first
((tenant, created_at)); with STRUCTSPEC_JOB_RETENTION_DAYS set, every worker looks for jobs
that finished before the cut-off (finished_at; worker/retention.py). Without these both scan
the whole table.
"""

from __future__ import annotations

from typing import Sequence

from alembic import op

revision: str = "0011"
down_revision: str | None = "0010"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_index("ix_jobs_finished_at", "jobs", ["finished_at"])
    op.create_index("ix_jobs_tenant_created_at", "jobs", ["tenant", "created_at"])
    op.create_index("ix_batches_tenant_created_at", "batches", ["tenant", "created_at"])


def downgrade() -> None:
    op.drop_index("ix_batches_tenant_created_at", table_name="batches")
    op.drop_index("ix_jobs_tenant_created_at", table_name="jobs")
    op.drop_index("ix_jobs_finished_at", table_name="jobs")
