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
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future

from structspec.engine.engine import Engine
from structspec.engine.sequence import ExtractResult, Request

log = logging.getLogger(__name__)


class EngineLoop:
    """`engine`: an Engine, or a callable that builds one (in the loop thread; the constructor
    returns once it is built and raises what building raised)."""

    def __init__(self, engine: Engine | Callable[[], Engine], name: str = "engine-loop"):
        self.engine: Engine | None = engine if isinstance(engine, Engine) else None
        self._factory = None if isinstance(engine, Engine) else engine
        self._inbox: queue.Queue = queue.Queue()
        self._futures: dict[str, Future] = {}
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._build_error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._build_error is not None:
            raise self._build_error

    @property
    def busy(self) -> bool:
        """Whether requests are running or waiting to be taken (read from any thread)."""
        return bool(self._futures) or not self._inbox.empty()

    def submit(self, request: Request) -> "Future[ExtractResult]":
        future: Future = Future()
        self._inbox.put(("submit", request, future))
        return future

    def cancel(self, request_id: str) -> None:
        self._inbox.put(("cancel", request_id, None))

    def stop(self, timeout: float = 10) -> None:
        self._stop.set()
        self._inbox.put(("wake", None, None))
        self._thread.join(timeout)

    def _drain(self, block: bool) -> None:
        try:
            item = self._inbox.get(timeout=1.0) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            self._handle(*item)
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
        while not self._stop.is_set():
            self._drain(block=not self.engine.has_work())
            if not self.engine.has_work():
                continue
            try:
                results = self.engine.step()
            except Exception as e:  # a bug in the engine itself: fail what it held, keep serving
                log.exception("engine step crashed")
                self._fail_all(e)
                continue
            for res in results:
                future = self._futures.pop(res.request_id, None)
                if future is not None:
                    future.set_result(res)
        self._fail_all(RuntimeError("the engine loop stopped"))

    def _fail_all(self, error: Exception) -> None:
        self.engine.abort_all()
        for future in self._futures.values():
            future.set_exception(error)
        self._futures.clear()
