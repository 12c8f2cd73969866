"""jobs.messages: the chat messages of a job from the OpenAI-compatible surface

Revision ID: 0008
Revises: 0007
Create Date: 2026-11-23

A job submitted through /openai/v1/chat/completions is prompted with its messages through the
model's chat template rather than with the extraction prompt; `document` then holds their
text. NULL for every other job.
"""

from __future__ import annotations

from typing import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0008"
down_revision: str | None = "0007"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("messages", sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("messages")
