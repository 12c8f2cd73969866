"""jobs.published_at: when a message for the job was last published

Revision ID: 0007
Revises: 0006
Create Date: 2026-11-23

The reaper publishes a `queued` job again once its message has been out longer than
STRUCTSPEC_JOB_REPUBLISH_AFTER_S with the broker's queue empty (the message was lost: the
API died between commit and publish, or a broker dropped it). Existing rows get their
created_at, the time the API published them.
"""

from __future__ import annotations

from typing import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0007"
down_revision: str | None = "0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("published_at", sa.DateTime(timezone=True), nullable=True))
    op.execute(sa.text("UPDATE jobs SET published_at = created_at"))


def downgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("published_at")
