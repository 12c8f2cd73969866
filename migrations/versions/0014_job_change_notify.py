"""jobs: a PostgreSQL trigger that NOTIFYs the API when a job ends, changes its streamed
output or is deleted

Revision ID: 0014
Revises: 0013
Create Date: 2026-11-25

Requests that wait on a job (`POST /v1/extractions?wait=`, OpenAI chat completions, streamed or
not) sleep on `LISTEN structspec_jobs` in the API process (api/services/waiting.py) instead of
polling the row. The trigger, not the code that writes, sends the notification, so every writer
(a worker storing a result, the reaper failing a job, a cancel, a delete, the progress writer)
wakes the waiters, and PostgreSQL delivers it only when that transaction commits: a woken waiter
always reads the committed row. SQLite has no NOTIFY: there the API polls (one query per tick
for all the jobs its requests wait on), and this revision does nothing.
"""

from __future__ import annotations

from typing import Sequence

from alembic import op

revision: str = "0014"
down_revision: str | None = "0013"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# structspec.db.jobs.JOB_CHANGES_CHANNEL; spelled out here: a revision stays as it was written
CHANNEL = "structspec_jobs"


def upgrade() -> None:
    if op.get_bind().dialect.name != "postgresql":
        return
    op.execute(f"""
        CREATE FUNCTION structspec_job_changed() RETURNS trigger LANGUAGE plpgsql AS $$
        BEGIN
            IF TG_OP = 'DELETE' THEN
                PERFORM pg_notify('{CHANNEL}', OLD.id::text);
                RETURN OLD;
            END IF;
            IF (NEW.status IS DISTINCT FROM OLD.status
                    AND NEW.status IN ('succeeded', 'failed', 'cancelled'))
                    OR NEW.partial::text IS DISTINCT FROM OLD.partial::text THEN
                PERFORM pg_notify('{CHANNEL}', NEW.id::text);
            END IF;
            RETURN NEW;
        END
        $$""")
    op.execute("CREATE TRIGGER jobs_changed AFTER UPDATE OR DELETE ON jobs "
               "FOR EACH ROW EXECUTE FUNCTION structspec_job_changed()")


def downgrade() -> None:
    if op.get_bind().dialect.name != "postgresql":
        return
    op.execute("DROP TRIGGER IF EXISTS jobs_changed ON jobs")
    op.execute("DROP FUNCTION IF EXISTS structspec_job_changed()")
