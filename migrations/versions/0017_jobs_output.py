"""jobs.output: a succeeded job's output text as the model wrote it

Revision ID: 0017
Revises: 0016
Create Date: 2026-12-05

The suffix proposer (structspec/engine/proposers/suffix.py) drafts from a schema's earlier
outputs in the model's own layout (whitespace, key order), which `result` (the parsed value)
does not keep. A worker that starts rebuilds each schema's index from the latest of these
(worker/tasks.py: history_seed). NULL for jobs that did not succeed, for a document extracted
in chunks (its result is a merge, not one output) and for jobs stored before.
"""

from __future__ import annotations

from typing import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0017"
down_revision: str | None = "0016"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("output", sa.Text(), nullable=True))
    op.create_index("ix_jobs_schema_id_finished_at", "jobs", ["schema_id", "finished_at"])


def downgrade() -> None:
    op.drop_index("ix_jobs_schema_id_finished_at", table_name="jobs")
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("output")
