"""The engine loop (engine/loop.py): built in its own thread from a factory, so that one thread
does all of a worker's torch work."""

from __future__ import annotations

import threading

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
