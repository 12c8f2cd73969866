"""jobs.spans and jobs.confidence: a succeeded result's grounding

Revision ID: 0010
Revises: 0009
Create Date: 2026-11-23

By JSON Pointer: where each string of the result occurs in the document ([start, end) or
null), and the target's probabilities of the tokens that wrote each leaf ({min, mean});
engine/grounding.py. NULL for jobs stored before this revision and for unfinished or failed
ones.
"""

from __future__ import annotations

from typing import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0010"
down_revision: str | None = "0009"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("spans", sa.JSON(), nullable=True))
        batch.add_column(sa.Column("confidence", sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("confidence")
        batch.drop_column("spans")
