"""create acceptance statistics and strategy pin tables

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-22
"""

from __future__ import annotations

from typing import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0003"
down_revision: str | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "schema_arm_stats",
        sa.Column("schema_id", sa.Uuid(), nullable=False),
        sa.Column("strategy", sa.String(length=16), nullable=False),
        sa.Column("draft_len", sa.Integer(), nullable=False),
        sa.Column("requests", sa.BigInteger(), nullable=False),
        sa.Column("output_tokens", sa.BigInteger(), nullable=False),
        sa.Column("target_passes", sa.BigInteger(), nullable=False),
        sa.Column("proposed", sa.BigInteger(), nullable=False),
        sa.Column("accepted", sa.BigInteger(), nullable=False),
        sa.Column("decode_s", sa.Float(), nullable=False),
        sa.Column("latency_s_sum", sa.Float(), nullable=False),
        sa.Column("latency_buckets", sa.JSON(), nullable=False),
        sa.Column("d_requests", sa.Float(), nullable=False),
        sa.Column("d_passes", sa.Float(), nullable=False),
        sa.Column("d_decode_s", sa.Float(), nullable=False),
        sa.Column("seen_at", sa.BigInteger(), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(["schema_id"], ["schemas.id"], name=op.f("fk_schema_arm_stats_schema_id_schemas"),
                                ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("schema_id", "strategy", "draft_len", name=op.f("pk_schema_arm_stats")),
    )
    op.create_table(
        "schema_position_stats",
        sa.Column("schema_id", sa.Uuid(), nullable=False),
        sa.Column("strategy", sa.String(length=16), nullable=False),
        sa.Column("draft_len", sa.Integer(), nullable=False),
        sa.Column("position", sa.Integer(), nullable=False),
        sa.Column("proposed", sa.BigInteger(), nullable=False),
        sa.Column("accepted", sa.BigInteger(), nullable=False),
        sa.Column("d_accepted", sa.Float(), nullable=False),
        sa.ForeignKeyConstraint(["schema_id", "strategy", "draft_len"],
                                ["schema_arm_stats.schema_id", "schema_arm_stats.strategy",
                                 "schema_arm_stats.draft_len"],
                                name=op.f("fk_schema_position_stats_schema_id_schema_arm_stats"),
                                ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("schema_id", "strategy", "draft_len", "position",
                                name=op.f("pk_schema_position_stats")),
    )
    op.create_table(
        "schema_strategy_pins",
        sa.Column("schema_id", sa.Uuid(), nullable=False),
        sa.Column("strategy", sa.String(length=16), nullable=False),
        sa.Column("draft_len", sa.Integer(), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(["schema_id"], ["schemas.id"],
                                name=op.f("fk_schema_strategy_pins_schema_id_schemas"), ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("schema_id", name=op.f("pk_schema_strategy_pins")),
    )


def downgrade() -> None:
    op.drop_table("schema_strategy_pins")
    op.drop_table("schema_position_stats")
    op.drop_table("schema_arm_stats")
