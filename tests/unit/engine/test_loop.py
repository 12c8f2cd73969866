"""The engine loop (engine/loop.py): built in its own thread from a factory, so that one thread
does all of a worker's torch work."""

from __future__ import annotations

import threading
import time

import pytest

from structspec.engine.engine import Engine
from structspec.engine.loop import EngineLoop
from structspec.engine.sequence import Request
from structspec.options import RequestOptions

SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}


def test_a_factory_builds_the_engine_in_the_loop_thread_which_then_serves(tiny_loaded):
    built_in = []

    def build():
        built_in.append(threading.current_thread().name)
        return Engine(tiny_loaded, engine_max_seqs=2)

    loop = EngineLoop(build, name="engine-loop-test")
    try:
        assert built_in == ["engine-loop-test"] and isinstance(loop.engine, Engine)
        res = loop.submit(Request(SCHEMA, "n is 4", RequestOptions(strategy="none", max_tokens=8))).result(timeout=120)
        assert res.stats.output_tokens > 0 and res.request_id  # it ran there (the tiny model may not finish in 8)
        assert not loop.busy  # nothing running or waiting once the result is in
    finally:
        loop.stop()


def test_the_loop_is_busy_while_a_request_runs(tiny_loaded):
    """`busy` (the worker's embedded broker polls less while it holds) from a submit until its
    result."""
    started, release = threading.Event(), threading.Event()

    class Held(Engine):  # a step that waits until the test has looked
        def step(self):
            started.set()
            release.wait(60)
            return super().step()

    loop = EngineLoop(Held(tiny_loaded, engine_max_seqs=2))
    try:
        assert not loop.busy
        future = loop.submit(Request(SCHEMA, "n is 4", RequestOptions(strategy="none", max_tokens=4)))
        assert loop.busy  # waiting in the inbox or taken: busy either way
        assert started.wait(60) and loop.busy
        release.set()
        future.result(timeout=120)
        assert not loop.busy
    finally:
        release.set()
        loop.stop()


def test_a_factory_that_fails_raises_in_the_caller_and_leaves_no_thread():
    def build():
        raise RuntimeError("no model today")

    before = threading.active_count()
    with pytest.raises(RuntimeError, match="no model today"):
        EngineLoop(build, name="engine-loop-broken")
    assert not any(t.name == "engine-loop-broken" for t in threading.enumerate())
    assert threading.active_count() == before


# --- the loop's guards: no future is left unresolved --------------------------------------------

class Broken(BaseException):
    """Not an Exception: what ends a thread (as a KeyboardInterrupt or a C extension's abort might)."""


class FakeEngine:
    """What the loop drives, without a model: each request ends after two steps. `on_*` hooks
    make a part of it raise or block."""

    def __init__(self):
        self.held: dict[str, int] = {}
        self.on_step = self.on_cancel = self.on_abort = self.on_submit = None

    def submit(self, request: Request) -> str:
        if self.on_submit:
            self.on_submit()
        self.held[request.id] = 2
        return request.id

    def cancel(self, request_id: str) -> bool:
        if self.on_cancel:
            self.on_cancel()
        return False

    def has_work(self) -> bool:
        return bool(self.held)

    def step(self):
        from structspec.engine.sequence import ExtractResult, RequestStats

        if self.on_step:
            self.on_step()
        done = []
        for rid in list(self.held):
            self.held[rid] -= 1
            if not self.held[rid]:
                del self.held[rid]
                done.append(ExtractResult("succeeded", {"n": 1}, '{"n":1}', [], RequestStats("none", 0),
                                          request_id=rid))
        return done

    def abort_all(self) -> None:
        if self.on_abort:
            self.on_abort()
        self.held.clear()


def request() -> Request:
    return Request(SCHEMA, "n is 1", RequestOptions(strategy="none", max_tokens=8))


def raise_(error: BaseException):
    def hook():
        raise error
    return hook


@pytest.fixture
def fake():
    engine = FakeEngine()
    loop = EngineLoop(lambda: engine, name="engine-loop-fake")
    yield engine, loop
    engine.on_step = None
    loop.stop()


def test_an_exception_handling_a_message_is_logged_and_the_loop_serves_on(fake, caplog):
    engine, loop = fake
    engine.on_cancel = raise_(RuntimeError("cancel broke"))
    future = loop.submit(request())
    loop.cancel("nobody")
    assert future.result(timeout=30).status == "succeeded"
    assert "handling 'cancel' failed" in caplog.text
    assert loop.submit(request()).result(timeout=30).status == "succeeded"
    assert loop.hung(0.0) is None  # its thread lives, and it holds nothing


def test_a_step_that_raises_fails_what_the_engine_held_even_when_dropping_it_raises_too(fake):
    engine, loop = fake
    engine.on_step, engine.on_abort = raise_(RuntimeError("step broke")), raise_(RuntimeError("abort broke"))
    futures = [loop.submit(request()) for _ in range(3)]
    for future in futures:
        with pytest.raises(RuntimeError, match="step broke"):
            future.result(timeout=30)
    engine.on_step = engine.on_abort = None
    assert loop.submit(request()).result(timeout=30).status == "succeeded"  # it serves on
    assert not loop.busy


def test_a_dead_loop_thread_fails_what_it_held_and_everything_submitted_after(fake):
    from structspec.engine.loop import EngineLoopDown

    engine, loop = fake
    engine.on_step = raise_(Broken("gone"))
    held = loop.submit(request())
    with pytest.raises(EngineLoopDown, match="thread died: Broken: gone"):
        held.result(timeout=30)
    later = loop.submit(request())
    assert later.done()  # at once: nothing would ever take it
    with pytest.raises(EngineLoopDown, match="not running"):
        later.result()
    assert loop.hung(3600) == "the engine loop's thread died" and not loop.busy


def test_hung_names_a_step_that_never_returns_and_never_an_idle_loop(fake):
    """The watchdog's question: no step ended for the limit while the loop held work."""
    from structspec.worker.watchdog import Watchdog

    engine, loop = fake
    time.sleep(0.5)
    assert loop.hung(0.2) is None  # idle for longer than the limit: not hung
    entered, release, verdicts = threading.Event(), threading.Event(), []
    engine.on_step = lambda: (entered.set(), release.wait(60))
    loop._progress_at -= 100  # its last tick long ago (a starved thread): only time holding work counts
    future = loop.submit(request())
    assert entered.wait(30)
    assert loop.hung(60) is None
    watchdog = Watchdog(loop, 0.5, verdicts.append).start()
    try:
        deadline = time.monotonic() + 30  # a bound on a busy machine; the verdict comes after ~0.5 s
        while not verdicts and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(verdicts) == 1 and verdicts[0].startswith("no engine step ended for "), verdicts
        assert verdicts[0].endswith(" s while it held work")
    finally:
        release.set()
        watchdog.stop()
    assert future.result(timeout=30).status == "succeeded"
    assert loop.hung(0.5) is None


def test_a_thread_that_dies_taking_a_request_fails_that_request_too(fake):
    """The request in hand is neither in the inbox nor held by the engine when the thread dies."""
    from structspec.engine.loop import EngineLoopDown

    engine, loop = fake
    engine.on_submit = raise_(Broken("mid-submit"))
    with pytest.raises(EngineLoopDown, match="thread died: Broken: mid-submit"):
        loop.submit(request()).result(timeout=30)
