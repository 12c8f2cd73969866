"""OpenAI-format Files and Batches, and the generated text of chat jobs

Revision ID: 0009
Revises: 0008
Create Date: 2026-11-23

- `files`: uploaded batch input files and the output/error files the service writes.
- `openai_batches`: a batch in OpenAI's Batch format; its requests are the jobs of a structspec
  batch with no schema (each request carries its own), so `batches.schema_id` becomes nullable.
- `jobs.partial` (the output text of a chat job, one piece per target pass) and `jobs.stream`
  (written while the job runs, for a streamed reply).
"""

from __future__ import annotations

from typing import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0009"
down_revision: str | None = "0008"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

UTC = sa.DateTime(timezone=True)


def upgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("partial", sa.JSON(), nullable=True))
        batch.add_column(sa.Column("stream", sa.Boolean(), nullable=False, server_default=sa.false()))
    with op.batch_alter_table("batches") as batch:
        batch.alter_column("schema_id", existing_type=sa.Uuid(), nullable=True)
    op.create_table(
        "files",
        sa.Column("id", sa.String(40), nullable=False),
        sa.Column("tenant", sa.String(64), nullable=False, server_default="default"),
        sa.Column("purpose", sa.String(32), nullable=False),
        sa.Column("filename", sa.String(255), nullable=False),
        sa.Column("bytes", sa.Integer(), nullable=False),
        sa.Column("content", sa.LargeBinary(), nullable=False),
        sa.Column("created_at", UTC, nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_files"),
    )
    op.create_index("ix_files_tenant_created_at", "files", ["tenant", "created_at"])
    op.create_table(
        "openai_batches",
        sa.Column("id", sa.String(40), nullable=False),
        sa.Column("tenant", sa.String(64), nullable=False, server_default="default"),
        sa.Column("batch_id", sa.Uuid(), nullable=True),
        sa.Column("input_file_id", sa.String(40), nullable=False),
        sa.Column("endpoint", sa.String(64), nullable=False),
        sa.Column("completion_window", sa.String(16), nullable=False),
        sa.Column("metadata", sa.JSON(), nullable=True),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("errors", sa.JSON(), nullable=True),
        sa.Column("total", sa.Integer(), nullable=False),
        sa.Column("invalid", sa.JSON(), nullable=False),
        sa.Column("output_file_id", sa.String(40), nullable=True),
        sa.Column("error_file_id", sa.String(40), nullable=True),
        *(sa.Column(name, UTC, nullable=name != "created_at") for name in (
            "created_at", "in_progress_at", "expires_at", "finalizing_at", "completed_at", "failed_at",
            "expired_at", "cancelling_at", "cancelled_at")),
        sa.ForeignKeyConstraint(["batch_id"], ["batches.id"], name="fk_openai_batches_batch_id_batches",
                                ondelete="SET NULL"),
        sa.PrimaryKeyConstraint("id", name="pk_openai_batches"),
    )
    op.create_index("ix_openai_batches_tenant_created_at", "openai_batches", ["tenant", "created_at"])


def downgrade() -> None:
    op.drop_index("ix_openai_batches_tenant_created_at", "openai_batches")
    op.drop_table("openai_batches")
    op.drop_index("ix_files_tenant_created_at", "files")
    op.drop_table("files")
    op.execute(sa.text("DELETE FROM jobs WHERE batch_id IN (SELECT id FROM batches WHERE schema_id IS NULL)"))
    op.execute(sa.text("DELETE FROM batches WHERE schema_id IS NULL"))
    with op.batch_alter_table("batches") as batch:
        batch.alter_column("schema_id", existing_type=sa.Uuid(), nullable=False)
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("stream")
        batch.drop_column("partial")
