"""jobs.finished_at index: the retention sweep finds expired jobs without a full scan

Revision ID: 0011
Revises: 0010
Create Date: 2026-11-24

With STRUCTSPEC_JOB_RETENTION_DAYS set, every worker deletes jobs (and batches) that finished
more than that many days ago (worker/retention.py); this index keeps that sweep cheap on a
large jobs table.
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


def downgrade() -> None:
    op.drop_index("ix_jobs_finished_at", table_name="jobs")
