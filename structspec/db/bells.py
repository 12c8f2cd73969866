"""Doorbells between the processes of one machine that share a SQLite file: what PostgreSQL's
NOTIFY and a networked broker's push give the other deployments, for the zero-setup default.

The embedded broker (kombu over SQLite) and the SQLite job store can only be polled. Each poll
is a query, so the polls are spaced (worker/app.py, api/services/waiting.py), and a lone job
used to wait half a broker tick before a worker saw it and half a waiter tick before its
`?wait` request saw it finish. A process that polls a file also binds a doorbell: a Unix
datagram socket named `<role>-<pid>` in `<file>.bells/`. Whoever changes what it polls for
rings every bell of that role there (one datagram each, never blocking); the poller looks at
once instead of at its next tick. A ring is only a hint: the polls go on, and a lost ring (a
full socket buffer, a process that has no bell) costs one tick. A poller that has its bell
spaces its ticks further apart where every change it polls for rings (the API's job waiter;
the worker's looks at the broker while its engine is busy): fewer queries for the same news.

A bell whose process is gone refuses the datagram and is removed by the next ring. Anything
that goes wrong with bells (a path too long for a Unix socket, a platform without them, a
read-only directory) leaves the process polling alone, with one debug line saying why.
"""

from __future__ import annotations

import logging
import os
import select
import socket
import time
from pathlib import Path

from structspec.db.session import sqlite_path

log = logging.getLogger(__name__)

WORKER = "worker"  # rung when a job message is published (the embedded broker's file)
API = "api"  # rung when a job ends, its streamed output grows or it is deleted (structspec/db/jobs.py)

_MAX_PATH = 100  # bytes: sockaddr_un's sun_path holds 104-108 with its terminator


def bells_dir(url: str) -> Path | None:
    """The bells' directory of a SQLite URL's file (kombu's `sqla+sqlite:` too); None for any
    other database or broker (they push), or in-memory SQLite."""
    path = sqlite_path(url)
    if path is None:
        return None
    path = path.expanduser().absolute()
    return path.with_name(path.name + ".bells")


class Bell:
    """This process's doorbell of `role` in `directory`: fileno() for a selector, wait(s) to
    sleep until rung or s passed, drain() to take the rings that came."""

    def __init__(self, directory: Path, role: str):
        self.path = directory / f"{role}-{os.getpid()}"
        if len(os.fsencode(self.path)) > _MAX_PATH:
            raise OSError(f"{self.path} is too long for a Unix socket")
        directory.mkdir(parents=True, exist_ok=True)
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        try:
            self._sock.setblocking(False)
            try:
                self.path.unlink()  # a process of this pid that is gone left it
            except FileNotFoundError:
                pass
            self._sock.bind(str(self.path))
        except BaseException:
            self._sock.close()
            raise

    @classmethod
    def open(cls, url: str, role: str) -> "Bell | None":
        """A bell for the SQLite file of `url`, or None (not SQLite, or bells do not work here)."""
        directory = bells_dir(url)
        if directory is None or not hasattr(socket, "AF_UNIX"):
            return None
        try:
            return cls(directory, role)
        except OSError as e:
            log.debug("no %s doorbell (polling alone): %s", role, e)
            return None

    def fileno(self) -> int:
        return self._sock.fileno()

    def drain(self) -> bool:
        """Take every ring that has come; whether there was one."""
        rung = False
        while True:
            try:
                self._sock.recv(64)
                rung = True
            except (BlockingIOError, InterruptedError):
                return rung
            except OSError:
                return rung

    def wait(self, seconds: float) -> bool:
        """Sleep up to `seconds`, less if rung; whether it was rung."""
        if seconds > 0:
            try:
                select.select([self._sock], [], [], seconds)
            except (OSError, ValueError):  # closed under us: sleep as a poll without a bell does
                time.sleep(seconds)
                return False
        return self.drain()

    def close(self) -> None:
        self._sock.close()
        try:
            self.path.unlink()
        except OSError:
            pass


def ring(url: str, role: str) -> int:
    """Ring every bell of `role` beside `url`'s SQLite file; how many were rung. Never raises,
    never blocks: a bell that is gone is removed, a full one has been rung already."""
    directory = bells_dir(url)
    if directory is None:
        return 0
    try:
        names = [n for n in os.listdir(directory) if n.startswith(role + "-")]
    except OSError:
        return 0
    if not names:
        return 0
    rung = 0
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.setblocking(False)
        for name in names:
            path = directory / name
            try:
                sock.sendto(b"!", str(path))
                rung += 1
            except (ConnectionRefusedError, FileNotFoundError):  # its process is gone
                try:
                    path.unlink()
                except OSError:
                    pass
            except OSError:  # BlockingIOError: its buffer is full of rings it has not taken yet
                pass
    return rung
