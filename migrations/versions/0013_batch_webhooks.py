"""batches.webhook_*: a URL POSTed once every job of the batch has finished

Revision ID: 0013
Revises: 0012
Create Date: 2026-11-24

worker/webhooks.py delivers it from every worker's reaper round: webhook_delivered_at once the
URL answered 2xx; until then webhook_attempts counts the tries, webhook_next_at holds the next
one back (a try in flight, or a backoff after a failure) and webhook_error the last failure.
"""

from __future__ import annotations

from typing import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0013"
down_revision: str | None = "0012"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

UTC = sa.DateTime(timezone=True)


def upgrade() -> None:
    with op.batch_alter_table("batches") as batch:
        batch.add_column(sa.Column("webhook_url", sa.String(2048), nullable=True))
        batch.add_column(sa.Column("webhook_delivered_at", UTC, nullable=True))
        batch.add_column(sa.Column("webhook_attempts", sa.Integer(), nullable=False, server_default="0"))
        batch.add_column(sa.Column("webhook_next_at", UTC, nullable=True))
        batch.add_column(sa.Column("webhook_error", sa.Text(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("batches") as batch:
        for column in ("webhook_error", "webhook_next_at", "webhook_attempts", "webhook_delivered_at", "webhook_url"):
            batch.drop_column(column)
