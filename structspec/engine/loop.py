"""An engine stepped by a thread of its own, fed by other threads (the worker's task threads).

Requests from many callers join the same running batch: each `submit` returns a Future that
resolves to the request's ExtractResult (or raises what Engine.submit raises for a request
that cannot run). The engine itself is only ever touched by the loop thread.
"""

from __future__ import annotations

import logging
import queue
import threading
from concurrent.futures import Future

from structspec.engine.engine import Engine
from structspec.engine.sequence import ExtractResult, Request

log = logging.getLogger(__name__)


class EngineLoop:
    def __init__(self, engine: Engine, name: str = "engine-loop"):
        self.engine = engine
        self._inbox: queue.Queue = queue.Queue()
        self._futures: dict[str, Future] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

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
