"""widen the stats strategy columns for verbatim arms ("composite+verbatim")

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-22
"""

from __future__ import annotations

from typing import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0004"
down_revision: str | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# Referencing table first (schema_position_stats has a foreign key to schema_arm_stats).
COLUMNS = (("schema_position_stats", "strategy"), ("schema_arm_stats", "strategy"))


def _retype_all(old: int, new: int) -> None:
    """SQLite cannot ALTER a column's type: batch mode copies each table (small: one row per
    arm) and drops the original, and SQLite's DROP deletes its rows first, which cascades to
    schema_position_stats. So on SQLite the position rows are kept aside and put back."""
    sqlite = op.get_bind().dialect.name == "sqlite"
    if sqlite:
        op.execute(sa.text("CREATE TEMP TABLE _structspec_positions AS SELECT * FROM schema_position_stats"))
    for table, column in reversed(COLUMNS):
        with op.batch_alter_table(table) as batch:
            batch.alter_column(column, type_=sa.String(length=new), existing_type=sa.String(length=old),
                               existing_nullable=False)
    if sqlite:
        op.execute(sa.text("DELETE FROM schema_position_stats"))
        op.execute(sa.text("INSERT INTO schema_position_stats SELECT * FROM _structspec_positions"))
        op.execute(sa.text("DROP TABLE _structspec_positions"))


def upgrade() -> None:
    _retype_all(16, 32)


def downgrade() -> None:
    # Verbatim arms do not fit the old width, and the old code cannot read them: drop them.
    for table, _ in COLUMNS:
        op.execute(sa.text(f"DELETE FROM {table} WHERE length(strategy) > 16"))
    _retype_all(32, 16)
