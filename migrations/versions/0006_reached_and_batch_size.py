"""per-position `reached` counts and the per-arm batch size sum, for the batched engine

Revision ID: 0006
Revises: 0005
Create Date: 2026-11-23

`schema_position_stats.reached` / `d_reached`: passes in which draft position i was offered
(the step's k > i) with positions < i accepted, the selector's trials of position i. Before
batching every pass was offered the arm's full draft_len, so existing rows get exactly what
the selector derived until now: position 0 the arm's target_passes / d_passes, position i
the accepted / d_accepted of position i-1. An arm whose last stored position p < draft_len - 1
had passes reach p + 1 (accepted through p, then the grammar cut the draft): it gets a row
p + 1 with nothing proposed, so its history is preserved exactly (and so does an arm with
passes but no position rows, at position 0).

`schema_arm_stats.batch_size_sum`: sum over requests of each job's mean batch size; every
job so far ran one document at a time, so existing rows get their request count.

The columns are added NOT NULL with a server default and then filled. SQLite adds such a
column in place (ALTER TABLE .. ADD COLUMN), so the upgrade copies no table and cannot
cascade-delete position rows; the downgrade does copy both tables (see _drop_arm_column).
"""

from __future__ import annotations

from typing import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0006"
down_revision: str | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

SAME_ARM = "{a}.schema_id = {b}.schema_id AND {a}.strategy = {b}.strategy AND {a}.draft_len = {b}.draft_len"
P = "schema_position_stats"


def upgrade() -> None:
    # A plain string default, not sa.text: alembic's SQLite batch mode would copy the table
    # for a SQL-expression default.
    with op.batch_alter_table(P) as batch:
        batch.add_column(sa.Column("reached", sa.BigInteger(), nullable=False, server_default="0"))
        batch.add_column(sa.Column("d_reached", sa.Float(), nullable=False, server_default="0"))
    with op.batch_alter_table("schema_arm_stats") as batch:
        batch.add_column(sa.Column("batch_size_sum", sa.Float(), nullable=False, server_default="0"))

    arm = "SELECT a.{col} FROM schema_arm_stats a WHERE " + SAME_ARM.format(a="a", b=P)
    op.execute(sa.text(f"UPDATE {P} SET reached = ({arm.format(col='target_passes')}), "
                       f"d_reached = ({arm.format(col='d_passes')}) WHERE position = 0"))
    before = "SELECT q.{col} FROM " + P + " q WHERE " + SAME_ARM.format(a="q", b=P) + f" AND q.position = {P}.position - 1"
    op.execute(sa.text(f"UPDATE {P} SET reached = COALESCE(({before.format(col='accepted')}), 0), "
                       f"d_reached = COALESCE(({before.format(col='d_accepted')}), 0) WHERE position > 0"))
    # the position after each arm's last row (0 for an arm without rows), where passes reached it
    last = f"SELECT max(q.position) FROM {P} q WHERE " + SAME_ARM.format(a="q", b="a")
    op.execute(sa.text(
        f"INSERT INTO {P} (schema_id, strategy, draft_len, position, proposed, accepted, d_accepted, reached, d_reached) "
        "SELECT a.schema_id, a.strategy, a.draft_len, COALESCE(p.position + 1, 0), 0, 0, 0, "
        "COALESCE(p.accepted, a.target_passes), COALESCE(p.d_accepted, a.d_passes) "
        f"FROM schema_arm_stats a LEFT JOIN {P} p ON " + SAME_ARM.format(a="p", b="a") + f" AND p.position = ({last}) "
        "WHERE COALESCE(p.position + 1, 0) < a.draft_len AND COALESCE(p.accepted, a.target_passes) > 0"))
    op.execute(sa.text("UPDATE schema_arm_stats SET batch_size_sum = requests"))


def downgrade() -> None:
    # Rows that only count `reached` (nothing proposed there) mean nothing to the old code;
    # proposing position i implies proposing 0..i-1, so these are each arm's last rows.
    op.execute(sa.text(f"DELETE FROM {P} WHERE proposed = 0"))
    with op.batch_alter_table(P) as batch:
        batch.drop_column("d_reached")
        batch.drop_column("reached")
    _drop_arm_column("batch_size_sum")


def _drop_arm_column(column: str) -> None:
    """On SQLite batch mode copies schema_arm_stats and drops the original, and with foreign
    keys on (a caller's connection inside a transaction; migrations/env.py turns them off
    otherwise) that DROP cascades to schema_position_stats: keep those rows aside, as 0004 does."""
    sqlite = op.get_bind().dialect.name == "sqlite"
    if sqlite:
        op.execute(sa.text(f"CREATE TEMP TABLE _structspec_positions AS SELECT * FROM {P}"))
    with op.batch_alter_table("schema_arm_stats") as batch:
        batch.drop_column(column)
    if sqlite:
        op.execute(sa.text(f"DELETE FROM {P}"))
        op.execute(sa.text(f"INSERT INTO {P} SELECT * FROM _structspec_positions"))
        op.execute(sa.text("DROP TABLE _structspec_positions"))
