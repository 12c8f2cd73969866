"""An engine stepped by a thread of its own, fed by other threads (the worker's task threads).

Requests from many callers join the same running batch: each `submit` returns a Future that
resolves to the request's ExtractResult (or raises what Engine.submit raises for a request
that cannot run). The engine itself is only ever touched by the loop thread.

Given a factory instead of an engine, the loop thread builds the engine itself, so that the
process's torch work (model load, start-up checks, every step) runs in one thread. That matters
on a CPU: torch's OpenMP runtime (libgomp) keeps a thread pool per thread that ran a parallel
region, and once the pools' threads outnumber the cores it stops spin-waiting between
regions, so every operator pays futex wake-ups. An engine built in the main thread and stepped
in this one ran a batch 1.3x slower (docs/benchmarks.md, "The service path").

No future is left unresolved: an exception while the loop handles a request fails that request,
one in a step (or in dropping the engine's requests after it) fails every request held then, and
the loop serves on; if its thread ends, stopped or dead, every request held or submitted later
fails with EngineLoopDown. `hung` tells a watchdog (worker/watchdog.py) when the loop holds work
and no step has ended for too long, or its thread died.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future

from structspec.engine.engine import Engine
from structspec.engine.sequence import ExtractResult, Request

log = logging.getLogger(__name__)


class EngineLoopDown(RuntimeError):
    """The engine loop stopped, or its thread died, before the request ended: it has no result."""


class EngineLoop:
    """`engine`: an Engine, or a callable that builds one (in the loop thread; the constructor
    returns once it is built and raises what building raised)."""

    def __init__(self, engine: Engine | Callable[[], Engine], name: str = "engine-loop"):
        self.engine: Engine | None = engine if isinstance(engine, Engine) else None
        self._factory = None if isinstance(engine, Engine) else engine
        self._inbox: queue.Queue = queue.Queue()
        self._futures: dict[str, Future] = {}
        self._in_hand: Future | None = None  # the submission being handed to the engine
        self._lock = threading.Lock()
        self._open = 0  # futures submitted and not resolved yet (under _lock)
        self._closed = False  # the thread is ending: submit fails at once (under _lock)
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._build_error: BaseException | None = None
        self._progress_at = time.monotonic()  # the last time a step ended or the loop idled
        self._busy_since = self._progress_at  # when it last went from holding nothing to holding work
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._build_error is not None:
            raise self._build_error

    @property
    def busy(self) -> bool:
        """Whether requests are running or waiting to be taken (read from any thread)."""
        return self._open > 0

    def submit(self, request: Request) -> "Future[ExtractResult]":
        future: Future = Future()
        with self._lock:
            if self._closed:
                future.set_exception(EngineLoopDown("the engine loop is not running"))
                return future
            if not self._open:  # time holding nothing is no stall, however long since the last tick
                self._busy_since = time.monotonic()
            self._open += 1
            future.add_done_callback(self._resolved)
            self._inbox.put(("submit", request, future))
        return future

    def _resolved(self, _: Future) -> None:
        with self._lock:
            self._open -= 1

    def cancel(self, request_id: str) -> None:
        self._inbox.put(("cancel", request_id, None))

    def stop(self, timeout: float = 10) -> None:
        self._stop.set()
        self._inbox.put(("wake", None, None))
        self._thread.join(timeout)

    def hung(self, limit_s: float) -> str | None:
        """Why this loop can no longer be relied on, or None: its thread died (a stop is not a
        death), or it has held work for `limit_s` seconds with no step ending."""
        if self._stop.is_set() or not self._ready.is_set():
            return None
        if not self._thread.is_alive():
            return "the engine loop's thread died"
        stalled = time.monotonic() - max(self._progress_at, self._busy_since)
        if self.busy and stalled >= limit_s:
            return f"no engine step ended for {stalled:.0f} s while it held work"
        return None

    def _drain(self, block: bool) -> None:
        try:
            item = self._inbox.get(timeout=1.0) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            self._in_hand = item[2]  # neither in the inbox nor held: _close must still see it
            try:
                self._handle(*item)
            except Exception as e:  # a bug handling one item: its caller hears of it, the loop goes on
                log.exception("engine loop: handling %r failed", item[0])
                _fail(item[2], e)
            self._in_hand = None
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _handle(self, kind: str, payload, future: Future | None) -> None:
        if kind == "submit":
            try:
                self.engine.submit(payload)
            except Exception as e:  # a request that cannot run: its caller sees why
                future.set_exception(e)
                return
            self._futures[payload.id] = future
        elif kind == "cancel":
            self.engine.cancel(payload)

    def _run(self) -> None:
        if self._factory is not None:
            try:
                self.engine = self._factory()
            except BaseException as e:  # the constructor re-raises it in the caller's thread
                self._build_error = e
                self._ready.set()
                return
        self._ready.set()
        try:
            self._serve()
        except BaseException as e:  # not an Exception (those are handled in _serve): the thread ends
            log.critical("the engine loop's thread died: %s: %s", type(e).__name__, e)
            self._close(EngineLoopDown(f"the engine loop's thread died: {type(e).__name__}: {e}"))
        else:
            self._close(EngineLoopDown("the engine loop stopped"))

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                self._drain(block=not self.engine.has_work())
                if self.engine.has_work():
                    for res in self.engine.step():
                        _succeed(self._futures.pop(res.request_id, None), res)
            except Exception as e:  # a bug in the engine itself: fail what it held, keep serving
                log.exception("engine step crashed")
                self._fail_all(e)
            self._progress_at = time.monotonic()

    def _fail_all(self, error: Exception) -> None:
        try:
            self.engine.abort_all()
        except Exception:  # its requests are failed below all the same
            log.exception("the engine could not drop its requests")
        futures, self._futures = self._futures, {}
        for future in futures.values():
            _fail(future, error)

    def _close(self, error: Exception) -> None:
        """The thread is ending: fail what it holds and what waits in the inbox, and refuse more."""
        with self._lock:
            self._closed = True
        self._fail_all(error)
        _fail(self._in_hand, error)
        while True:
            try:
                _, _, future = self._inbox.get_nowait()
            except queue.Empty:
                return
            _fail(future, error)


def _succeed(future: Future | None, result: ExtractResult) -> None:
    if future is not None and not future.done():
        future.set_result(result)


def _fail(future: Future | None, error: BaseException) -> None:
    if future is not None and not future.done():
        future.set_exception(error)
