"""files are read by workers: jobs.phase/source/intake/warnings/read_attempts; file_parts

Revision ID: 0016
Revises: 0015
Create Date: 2026-12-05

A document sent as a file (a PDF, an image) is no longer read while its request waits: the
job is stored with `phase` "reading" and the file's bytes (`source`, or an uploaded file named
in `intake`), and a worker on the ingest queue reads it (worker/ingest.py). Files' bytes move
from `files.content` to `file_parts` (pieces of up to 1 MiB), so that an upload is written, and
a file read, a piece at a time. Existing files are copied into one part each.
"""

from __future__ import annotations

from typing import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0016"
down_revision: str | None = "0015"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("phase", sa.String(16), nullable=True))
        batch.add_column(sa.Column("source", sa.LargeBinary(), nullable=True))
        batch.add_column(sa.Column("intake", sa.JSON(), nullable=True))
        batch.add_column(sa.Column("warnings", sa.JSON(), nullable=True))
        batch.add_column(sa.Column("read_attempts", sa.Integer(), nullable=False, server_default="0"))
    op.create_table(
        "file_parts",
        sa.Column("file_id", sa.String(40), sa.ForeignKey("files.id", ondelete="CASCADE",
                                                          name="fk_file_parts_file_id_files"), nullable=False),
        sa.Column("seq", sa.Integer(), nullable=False),
        sa.Column("data", sa.LargeBinary(), nullable=False),
        sa.PrimaryKeyConstraint("file_id", "seq", name="pk_file_parts"),
    )
    op.execute("INSERT INTO file_parts (file_id, seq, data) SELECT id, 0, content FROM files")
    with op.batch_alter_table("files") as batch:
        batch.add_column(sa.Column("media_type", sa.String(200), nullable=True))
        batch.drop_column("content")


def downgrade() -> None:
    with op.batch_alter_table("files") as batch:
        batch.add_column(sa.Column("content", sa.LargeBinary(), nullable=True))
        batch.drop_column("media_type")
    # one part per file back into `content` (parts in order, concatenated)
    bind = op.get_bind()
    files = sa.table("files", sa.column("id", sa.String), sa.column("content", sa.LargeBinary))
    parts = sa.table("file_parts", sa.column("file_id", sa.String), sa.column("seq", sa.Integer),
                     sa.column("data", sa.LargeBinary))
    for (file_id,) in bind.execute(sa.select(files.c.id)).all():
        data = b"".join(bind.execute(sa.select(parts.c.data).where(parts.c.file_id == file_id)
                                     .order_by(parts.c.seq)).scalars())
        bind.execute(sa.update(files).where(files.c.id == file_id).values(content=data))
    op.drop_table("file_parts")
    with op.batch_alter_table("jobs") as batch:
        for column in ("read_attempts", "warnings", "intake", "source", "phase"):
            batch.drop_column(column)
