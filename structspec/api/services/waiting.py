"""Waiting on jobs without a thread: what `POST /v1/extractions?wait=` and the OpenAI chat
completions (plain and streamed) sleep on while a worker runs their job.

A waiting request holds no thread and no database connection: it subscribes to its job id on
the process's one `JobWaiter` and awaits an asyncio event, then re-reads the row (a short read
in a thread) when the event says the job may have changed. What sets the events:

- **PostgreSQL:** one `LISTEN structspec_jobs` connection per API process. A trigger on `jobs`
  (revision 0014) NOTIFYs the job id when a job ends, its streamed output grows or it is
  deleted, whoever wrote it (worker, reaper, cancel, delete), and only once that transaction
  has committed, so a woken request always reads the committed row. A dropped listener
  reconnects with backoff; until it is back every waiter re-reads its row each `POLL_S`, and
  on reconnecting every waiter is woken once (a notification sent meanwhile is lost).
- **SQLite** (the embedded default, no NOTIFY): one poller per process reads the status and
  output length of every job a request waits on, in one query, and wakes the requests whose job
  changed. What the trigger reports on PostgreSQL (a job ends, its streamed output grows, it is
  deleted) rings the process's doorbell once committed, whoever wrote it (structspec/db/jobs.py
  marks those writes; structspec/db/bells.py), and the poller reads at once. With a doorbell
  the tick is only a safety net for a lost ring, `SQLITE_RUNG_POLL_S`; without one (bells do not
  work here) it is `SQLITE_POLL_S`. The cost is one small query per tick or ring while anyone
  waits, however many wait.

Either way a waiter also re-reads its row after `SAFETY_S` without news (a lost notification
costs at most that), and stops waiting when its deadline passes or its client disconnects.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from typing import Any, AsyncIterator, Awaitable, Callable, TypeVar

import anyio
import sqlalchemy as sa
from sqlalchemy.engine import Engine, make_url

from structspec.db.bells import API, Bell
from structspec.db.jobs import JOB_CHANGES_CHANNEL
from structspec.db.models import JobRecord
from structspec.logs import preview

log = logging.getLogger(__name__)

T = TypeVar("T")

POLL_S = 0.2  # every waiter's own re-read while the PG listener is down
SQLITE_POLL_S = 0.05  # the SQLite poller's tick without a doorbell: a lone job's reply waits half of it on average
# ... and with one, where a ring wakes it: the tick only catches a lost ring, and a request waiting
# on a long job costs two queries a second, not 20 (a bulk batch's time did not measurably change
# either way: docs/benchmarks.md)
SQLITE_RUNG_POLL_S = 0.5
SAFETY_S = 5.0  # a waiter re-reads its row at least this often, notified or not
RECONNECT_S = (0.5, 10.0)  # the listener's backoff: first pause, longest pause


class JobWaiter:
    """Per API process: which requests wait on which job ids, and what wakes them."""

    def __init__(self, engine: Engine, database_url: str):
        self.engine = engine
        self.postgres = engine.dialect.name == "postgresql"
        self.database_url = database_url
        self._waiters: dict[uuid.UUID, set[asyncio.Event]] = {}
        self._task: asyncio.Task | None = None
        self.listening = False  # PostgreSQL: LISTEN is in place now
        self._bell: Bell | None = None  # SQLite: rung by workers that store a job
        self._rung: asyncio.Event | None = None

    # --- lifecycle (the app's startup and shutdown hooks) ---------------------------------------

    async def start(self) -> None:
        if not self.postgres:
            self._bell = Bell.open(self.database_url, API)
            if self._bell is not None:
                try:
                    asyncio.get_running_loop().add_reader(self._bell.fileno(), self._on_ring)
                    self._rung = asyncio.Event()
                except (NotImplementedError, RuntimeError) as e:  # a loop without readers: poll alone
                    log.debug("no job doorbell on this event loop: %s", e)
                    self._bell.close()
                    self._bell = None
        self._task = asyncio.create_task(self._listen() if self.postgres else self._poll(),
                                         name="job-waiter")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
            self._task = None
        if self._bell is not None:
            asyncio.get_running_loop().remove_reader(self._bell.fileno())
            self._bell.close()
            self._bell, self._rung = None, None

    # --- waiting ------------------------------------------------------------------------------

    @contextlib.contextmanager
    def subscribe(self, job_id: uuid.UUID):
        """An event set whenever `job_id` may have changed. Subscribe before reading the row, so
        a change between the read and the wait is not missed."""
        event = asyncio.Event()
        self._waiters.setdefault(job_id, set()).add(event)
        try:
            yield event
        finally:
            subscribers = self._waiters.get(job_id)
            if subscribers is not None:
                subscribers.discard(event)
                if not subscribers:
                    del self._waiters[job_id]

    def interval(self) -> float:
        """How long a waiter sleeps without news before it re-reads its row anyway."""
        return POLL_S if self.postgres and not self.listening else SAFETY_S

    async def changes(self, job_id: uuid.UUID, read: Callable[[], T], deadline: float) -> AsyncIterator[T]:
        """`read()` (run in a thread) now, then each time the job may have changed, until
        `deadline` (time.monotonic()) passes; the caller stops iterating when it has what it
        waits for. The last value is read at or after the deadline."""
        with self.subscribe(job_id) as event:
            while True:
                event.clear()
                yield await anyio.to_thread.run_sync(read)
                left = deadline - time.monotonic()
                if left <= 0:
                    return
                with anyio.move_on_after(min(left, self.interval())):
                    await event.wait()

    def wake(self, job_id: uuid.UUID) -> None:
        for event in self._waiters.get(job_id, ()):
            event.set()

    def wake_all(self) -> None:
        for events in self._waiters.values():
            for event in events:
                event.set()

    # --- PostgreSQL: LISTEN ---------------------------------------------------------------------

    async def _listen(self) -> None:
        import psycopg

        conninfo = make_url(self.database_url).set(drivername="postgresql").render_as_string(hide_password=False)
        pause = RECONNECT_S[0]
        while True:
            try:
                async with await psycopg.AsyncConnection.connect(conninfo, autocommit=True,
                                                                 connect_timeout=5) as conn:
                    await conn.execute(f"LISTEN {JOB_CHANGES_CHANNEL}")
                    self.listening, pause = True, RECONNECT_S[0]
                    self.wake_all()  # anything that ended while nobody listened
                    async for note in conn.notifies():
                        self._on_notify(note.payload)
            except asyncio.CancelledError:
                raise
            except Exception as e:
                log.warning("job notifications: listener lost (%s); waiting requests poll every %.1f s "
                            "until it reconnects", preview(e), POLL_S)
            self.listening = False
            self.wake_all()
            await asyncio.sleep(pause)
            pause = min(pause * 2, RECONNECT_S[1])

    def _on_notify(self, payload: str) -> None:
        try:
            job_id = uuid.UUID(payload)
        except ValueError:
            return
        self.wake(job_id)

    # --- SQLite: one poller -------------------------------------------------------------------

    def _on_ring(self) -> None:
        if self._bell is not None and self._bell.drain() and self._rung is not None:
            self._rung.set()

    async def _tick(self) -> None:
        """SQLITE_POLL_S without a doorbell; with one, until it rings, SQLITE_RUNG_POLL_S at most."""
        if self._rung is None:
            await asyncio.sleep(SQLITE_POLL_S)
            return
        with anyio.move_on_after(SQLITE_RUNG_POLL_S):
            await self._rung.wait()
        self._rung.clear()

    async def _poll(self) -> None:
        seen: dict[uuid.UUID, Any] = {}
        while True:
            await self._tick()
            ids = list(self._waiters)
            if not ids:
                seen.clear()
                continue
            try:
                states = await anyio.to_thread.run_sync(self._states, ids)
            except Exception as e:  # the waiters' own SAFETY_S re-reads carry on meanwhile
                log.warning("job notifications: polling failed: %s", preview(e))
                continue
            for job_id in ids:
                state = states.get(job_id)  # None: deleted
                if job_id not in seen or seen[job_id] != state:
                    seen[job_id] = state
                    self.wake(job_id)
            for gone in set(seen) - set(ids):
                del seen[gone]

    def _states(self, ids: list[uuid.UUID]) -> dict[uuid.UUID, tuple[str, int]]:
        J = JobRecord
        out: dict[uuid.UUID, tuple[str, int]] = {}
        with self.engine.connect() as conn:
            for start in range(0, len(ids), 500):
                rows = conn.execute(sa.select(J.id, J.status, sa.func.length(sa.cast(J.partial, sa.Text)))
                                    .where(J.id.in_(ids[start:start + 500])))
                out.update({job_id: (status, size or 0) for job_id, status, size in rows})
        return out


async def until_disconnected(receive: Callable[[], Awaitable[dict[str, Any]]]) -> None:
    """Returns once the client has gone away (the ASGI `http.disconnect` message). Call it only
    after the request body has been read."""
    while (await receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(receive: Callable[[], Awaitable[dict[str, Any]]],
                              work: Callable[[], Awaitable[T]]) -> tuple[T | None, bool]:
    """Run `work()`; stop it if the client disconnects first. (result, False), or (None, True)
    when the client went away; an exception of `work()` is raised as it is."""
    result: list[T] = []
    errors: list[Exception] = []
    gone = False
    async with anyio.create_task_group() as group:
        async def watch() -> None:
            nonlocal gone
            await until_disconnected(receive)
            gone = True
            group.cancel_scope.cancel()

        async def run() -> None:
            try:
                result.append(await work())
            except Exception as e:  # noqa: BLE001 - raised below as itself (an API error keeps its status)
                errors.append(e)
            group.cancel_scope.cancel()

        group.start_soon(watch)
        group.start_soon(run)
    if errors:  # not wrapped in the task group's ExceptionGroup, which the API would answer with a 500
        raise errors[0]
    return (result[0] if result else None), gone
