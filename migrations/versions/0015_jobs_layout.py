"""jobs.layout: where each character of a document sent as a PDF sits on its page

Revision ID: 0015
Revises: 0014
Create Date: 2026-11-25

`POST /v1/extractions` takes a PDF with a text layer (`content`, base64, and `media_type`); the
job stores the text the model reads in `document`, as before, and here each character's page
and box (structspec.ingest: encode_layout, zlib-compressed JSON), from which a read answers
each span's page and box. NULL for documents sent as text and for jobs stored before.
"""

from __future__ import annotations

from typing import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0015"
down_revision: str | None = "0014"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("layout", sa.LargeBinary(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("layout")
