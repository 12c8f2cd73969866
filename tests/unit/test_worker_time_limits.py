"""The worker's side of time limits (worker/tasks.py, worker/watchdog.py), without a broker or a
database: finish_jobs waits for each job a bounded time, a job whose engine loop went down is
left to its lease, and the watchdog's verdict stops lease renewal and exits the process."""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
from concurrent.futures import Future

import pytest

import structspec.worker.tasks as tasks
from structspec.config import Settings
from structspec.engine.sequence import Request
from structspec.options import RequestOptions
from structspec.worker.watchdog import EXIT_ENGINE_HUNG, Watchdog

SCHEMA = {"type": "object"}


def started(timeout_s: int | None, answer_in: float, stopped: list) -> tasks.Started:
    job_id = uuid.uuid4()
    return tasks.Started(job_id, uuid.uuid4(), None, {"job_id": str(job_id)},
                         Request(SCHEMA, "x", RequestOptions(timeout_s=timeout_s)), time.monotonic(), None,
                         answer_by=time.monotonic() + answer_in, stop=lambda: stopped.append(job_id))


def test_finish_jobs_fails_a_job_the_engine_never_answers_and_stops_it_there(monkeypatch):
    """The engine answers one job and never the other (a request it lost): finish_jobs returns
    anyway, once the unanswered job's time (its limit plus STRUCTSPEC_ENGINE_WATCHDOG_S, set by
    submit_jobs) is up, failing it with its time limit's error, and stops it in the engine."""
    stored, stopped = [], []
    monkeypatch.setattr(tasks, "finish_job",
                        lambda sessions, settings, job, future, token: stored.append((job, future)) or 1)
    settings = Settings(engine_watchdog_s=7, job_timeout_s=9)
    answered, lost = started(None, 60, stopped), started(3, 0.3, stopped)
    answer, never = Future(), Future()
    answer.set_result("done")
    returned = []
    waiter = threading.Thread(target=lambda: returned.append(
        tasks.finish_jobs(None, settings, {answer: answered, never: lost}, "token")), daemon=True)
    waiter.start()
    waiter.join(30)  # a bound for a busy machine; it returns after ~0.3 s
    assert not waiter.is_alive(), "finish_jobs still waits for a job the engine never answers"
    assert returned == [2] and stopped == [lost.job_id]
    [(first, got), (second, failed)] = stored
    assert first is answered and got is answer
    assert second is lost and not never.done()
    outcome = tasks.outcome_of(failed, second.fields)
    assert outcome == {"status": "failed", "error": (
        "timeout: the job ran longer than its limit of 3 s (options.timeout_s; server default "
        "STRUCTSPEC_JOB_TIMEOUT_S); the engine had not stopped it 7 s later (STRUCTSPEC_ENGINE_WATCHDOG_S)")}
    # a job with no timeout_s of its own is measured by the worker's default
    assert "limit of 9 s" in str(tasks.overdue(answered, settings).exception())


def test_submit_jobs_gives_each_job_its_limit_plus_the_watchdogs_time(monkeypatch):
    settings = Settings(engine_watchdog_s=40, job_timeout_s=100)
    job = started(None, 0, [])
    job.answer_by = float("inf")

    class Loop:
        def submit(self, request):
            return Future()

        def cancel(self, request_id):
            cancelled.append(request_id)

    cancelled, watched = [], {}
    keeper = type("Keeper", (), {"watch": lambda self, job_id, cb: watched.setdefault(job_id, cb)})()
    monkeypatch.setattr(tasks.PROCESS, "submissions", lambda settings: Loop())
    monkeypatch.setattr(tasks, "start_job", lambda sessions, settings, job_id, token: job)
    before = time.monotonic()
    running, stored = tasks.submit_jobs(None, settings, [job.job_id], "token", keeper)
    assert stored == 0 and list(running.values()) == [job]
    assert before + 140 <= job.answer_by <= time.monotonic() + 140
    job.stop()
    watched[job.job_id]()
    assert cancelled == [job.request.id] * 2  # the bounded wait and a lost lease stop it the same way


def test_a_job_whose_engine_loop_went_down_is_left_to_its_lease():
    from structspec.engine.loop import EngineLoopDown

    class NoDatabase:
        def begin(self):
            raise AssertionError("nothing may be stored")

    down: Future = Future()
    down.set_exception(EngineLoopDown("the engine loop's thread died: Broken: gone"))
    job = started(5, 60, [])
    assert tasks.outcome_of(down, job.fields) is None
    assert tasks.finish_job(NoDatabase(), Settings(), job, down, "token") == 0


def test_a_halted_lease_keeper_renews_no_more(monkeypatch):
    monkeypatch.setattr(tasks.LeaseKeeper, "_halted", threading.Event())  # this test's process-wide switch
    renewals = []

    class Repo:
        def __init__(self, session):
            pass

        def renew(self, token, lease_s):
            renewals.append(time.monotonic())

        def held_ids(self, token):
            return set()

    class Sessions:
        def begin(self):
            from contextlib import nullcontext
            return nullcontext(None)

    monkeypatch.setattr(tasks, "JobRepository", Repo)
    keeper = tasks.LeaseKeeper(Sessions(), "token", lease_s=1.5).start()  # renews every 0.5 s
    try:
        deadline = time.monotonic() + 30
        while not renewals and time.monotonic() < deadline:
            time.sleep(0.05)
        assert renewals, "the keeper never renewed"
        tasks.LeaseKeeper.halt()
        keeper._thread.join(30)  # it ends at its next round
        assert not keeper._thread.is_alive()
        count = len(renewals)
        time.sleep(1.2)
        assert len(renewals) == count
    finally:
        keeper.stop()


def test_engine_hung_stops_renewal_says_why_and_exits_with_its_own_status(monkeypatch, caplog):
    monkeypatch.setattr(logging.getLogger(), "handlers", [caplog.handler])  # not those earlier tests left behind
    monkeypatch.setattr(tasks.LeaseKeeper, "_halted", threading.Event())
    exits = []
    monkeypatch.setattr(os, "_exit", exits.append)
    with caplog.at_level(logging.CRITICAL, logger="structspec.worker"):
        tasks.engine_hung(Settings(engine_watchdog_s=12), "no engine step ended for 12 s while it held work")
    assert exits == [EXIT_ENGINE_HUNG] == [75]
    assert tasks.LeaseKeeper._halted.is_set()
    assert ("engine watchdog: no engine step ended for 12 s while it held work (STRUCTSPEC_ENGINE_WATCHDOG_S=12); "
            "this worker no longer renews its leases") in caplog.text


def test_the_watchdog_gives_its_first_verdict_once_and_nothing_once_stopped():
    class Loop:
        def __init__(self, verdicts):
            self.verdicts, self.asked = list(verdicts), 0

        def hung(self, limit_s):
            self.asked += 1
            return self.verdicts.pop(0) if self.verdicts else "still hung"

    heard = []
    loop = Loop([None, None, "hung"])
    watchdog = Watchdog(loop, 1.0, heard.append).start()  # asks every 0.1 s
    watchdog._thread.join(30)
    assert heard == ["hung"] and loop.asked == 3
    quiet = Watchdog(Loop([]), 1.0, heard.append).start()
    quiet.stop()
    assert not quiet._thread.is_alive() and heard == ["hung"]


@pytest.mark.parametrize("limit_s, interval", [(300, 5.0), (10, 1.0), (0.5, 0.1)])
def test_the_watchdog_looks_every_tenth_of_its_limit_within_bounds(limit_s, interval, monkeypatch):
    waits = []

    class Stop:
        def wait(self, seconds):
            waits.append(seconds)
            return True

    watchdog = Watchdog(None, limit_s, lambda reason: None)
    watchdog._stop = Stop()
    watchdog._run()
    assert waits == [interval]


def test_engine_hung_exits_even_when_the_log_cannot_be_written(monkeypatch):
    class Broken(logging.Handler):
        def emit(self, record):
            raise OSError("the log's disk is gone")

        def handleError(self, record):
            raise OSError("the log's disk is gone")

        def flush(self):
            raise OSError("the log's disk is gone")

    monkeypatch.setattr(tasks.LeaseKeeper, "_halted", threading.Event())
    exits = []
    monkeypatch.setattr(os, "_exit", exits.append)
    monkeypatch.setattr(logging.getLogger(), "handlers", [Broken()])
    with pytest.raises(OSError):  # the real os._exit never returns; this one lets the error through
        tasks.engine_hung(Settings(), "the engine loop's thread died")
    assert exits == [EXIT_ENGINE_HUNG] and tasks.LeaseKeeper._halted.is_set()
