"""The output text of chat jobs as it is generated (jobs.partial), for the OpenAI-compatible
surface: kept for every chat job and stored with its result (the reply's content is the text
as the model wrote it), and written while the job runs when it is streamed, so the API can send
each piece as it comes.

A piece is the text one target pass added: several tokens when a draft was accepted. Bytes are
decoded incrementally, so a character split across passes lands whole in the later piece.
"""

from __future__ import annotations

import codecs
import logging
import os
import threading
import time
import uuid

from structspec.db.jobs import JobRepository
from structspec.logs import preview

log = logging.getLogger("structspec.worker")

FLUSH_EVERY_S = 0.1


class Pieces:
    """Receives the output bytes of each pass (engine Request.on_output, engine thread) and
    keeps them as text pieces (read from other threads)."""

    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")
        self._pieces: list[str] = []
        self._lock = threading.Lock()

    def __call__(self, data: bytes) -> None:
        text = self._decoder.decode(data)
        if text:
            with self._lock:
                self._pieces.append(text)

    def close(self) -> list[str]:
        """All pieces, with any bytes still held (an unfinished character) flushed."""
        tail = self._decoder.decode(b"", final=True)
        with self._lock:
            if tail:
                self._pieces.append(tail)
            return list(self._pieces)

    def snapshot(self) -> list[str]:
        with self._lock:
            return list(self._pieces)


class ProgressWriter:
    """Writes the pieces of streamed jobs to jobs.partial every FLUSH_EVERY_S while they run
    (one transaction for all changed jobs). One per worker process, started on first use; while
    no streamed job runs, its thread waits to be told of one instead of waking every
    FLUSH_EVERY_S (a thread that wakes takes the core from the engine's OpenMP threads)."""

    def __init__(self) -> None:
        self._jobs: dict[uuid.UUID, tuple[str, Pieces, int]] = {}
        self._lock = threading.Condition(threading.Lock())  # notified when a job is watched
        self._pid: int | None = None
        self._sessions = None

    def watch(self, sessions, job_id: uuid.UUID, token: str, pieces: Pieces) -> None:
        with self._lock:
            self._jobs[job_id] = (token, pieces, 0)
            self._sessions = sessions
            self._lock.notify()
            if self._pid != os.getpid():  # first use in this process (a prefork child starts its own)
                self._pid = os.getpid()
                threading.Thread(target=self._run, name="progress-writer", daemon=True).start()

    def forget(self, job_id: uuid.UUID) -> None:
        with self._lock:
            self._jobs.pop(job_id, None)

    def _run(self) -> None:
        while True:
            with self._lock:
                self._lock.wait_for(lambda: self._jobs)
            time.sleep(FLUSH_EVERY_S)
            with self._lock:
                snapshots = [(j, token, pieces.snapshot(), sent) for j, (token, pieces, sent) in self._jobs.items()]
                sessions = self._sessions
            changed = [(j, token, snap) for j, token, snap, sent in snapshots if len(snap) != sent]
            if not changed:
                continue
            try:
                with sessions.begin() as session:
                    repo = JobRepository(session)
                    for job_id, token, pieces in changed:
                        repo.write_partial(job_id, token, pieces)
            except Exception as e:  # the next round writes them again; the result carries them all
                log.warning("could not write streamed output: %s", preview(e))
                continue
            with self._lock:
                for job_id, token, pieces in changed:
                    if job_id in self._jobs:
                        self._jobs[job_id] = (token, self._jobs[job_id][1], len(pieces))


PROGRESS = ProgressWriter()
