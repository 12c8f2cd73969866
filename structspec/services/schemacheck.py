"""A schema's registration check, run in a child process that is killed at its time limit.

What in the check can run long, or worse, for a schema within max_schema_bytes,
max_schema_depth and max_schema_nodes:

- the JSON Schema meta-schema check (jsonschema): linear in the schema's size, so bounded by
  those three limits;
- the llguidance compile: its ParserLimits fuel (the grammar_* settings) caps the work of
  building the grammar and its lexer, but not the depth of its own recursion: a chain of some
  thousand `$ref`s overflows its stack and the whole process dies (SIGSEGV);
- the productive check (grammar/productive.py): a fixed point over the `$ref` targets, whose
  rounds grow with the length of a `$ref` chain and whose work per round grows with the
  schema, so a long chain makes it quadratic; no fuel bounds it.

A thread cannot be stopped, and llguidance's fuel covers neither the crash nor the productive
check, so the whole check (meta-schema, annotations, grammar compile, productive check) runs in
a child process, one request at a time over a pipe. At `grammar_compile_timeout_s` the child is
killed (SIGKILL) and reaped: nothing of the refused check keeps running. A child that dies
(the grammar engine crashed) costs only itself; the schema is refused. Children are reused
(starting one costs an interpreter and the grammar engine's imports, not counted against the
time limit), at most MAX_CHILDREN per API process; further checks wait for a free one. The
answer is plain JSON, so nothing a child sends can run code in the API process.

`python -m structspec.services.schemacheck` is the child: it prints `ready`, then answers one
JSON line per request line until its stdin closes (the parent exited).
"""

from __future__ import annotations

import atexit
import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
from typing import Any

from structspec.layout import checkout

MAX_CHILDREN = 2  # checks running at once in one API process; a child holds the grammar engine's imports
START_TIMEOUT_S = 120.0  # a child's start (interpreter, jsonschema, llguidance), on a loaded machine too


class CheckTimeout(Exception):
    """The check did not answer within its time limit; its child was killed."""


class CheckCrashed(Exception):
    """The child died while checking (the grammar engine crashed on the schema)."""

    def __init__(self, returncode: int | None):
        self.returncode = returncode
        super().__init__(describe_exit(returncode))


def describe_exit(returncode: int | None) -> str:
    if returncode is not None and returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exited with status {returncode}"


class _Child:
    """One checker process and the unread part of its answers."""

    def __init__(self) -> None:
        env = dict(os.environ)
        # the child imports the same structspec as this process: a checkout first on its path (an
        # installed one is in the interpreter's site-packages)
        root = checkout()
        if root is not None:
            env["PYTHONPATH"] = str(root) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        self.proc = subprocess.Popen([sys.executable, "-m", "structspec.services.schemacheck"],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, close_fds=True)
        self.pid = self.proc.pid
        self._buffer = b""
        try:
            ready = self._line(START_TIMEOUT_S)
        except (CheckTimeout, CheckCrashed) as e:  # not the schema's fault: a 500, logged
            self.kill()
            raise RuntimeError(f"the schema checker process did not start ({e or 'no answer'})") from None
        except BaseException:
            self.kill()
            raise
        if ready != b"ready":
            self.kill()
            raise RuntimeError(f"the schema checker process did not start (it said {ready[:80]!r})")

    def ask(self, request: bytes, timeout_s: float) -> dict[str, Any]:
        try:
            self.proc.stdin.write(request + b"\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            self.kill()
            raise CheckCrashed(self.proc.returncode) from None
        return json.loads(self._line(timeout_s))

    def _line(self, timeout_s: float) -> bytes:
        deadline = time.monotonic() + timeout_s if timeout_s > 0 else None
        fd = self.proc.stdout.fileno()
        while b"\n" not in self._buffer:
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                raise CheckTimeout()
            ready, _, _ = select.select([fd], [], [], remaining)
            if not ready:
                raise CheckTimeout()
            chunk = os.read(fd, 1 << 16)
            if not chunk:  # the child is gone
                self.proc.wait()
                raise CheckCrashed(self.proc.returncode)
            self._buffer += chunk
        line, _, self._buffer = self._buffer.partition(b"\n")
        return line

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()  # reaped: no zombie, and nothing of it still runs
        for stream in (self.proc.stdin, self.proc.stdout):
            try:
                stream.close()
            except OSError:
                pass


class SchemaChecker:
    """Checker children of this process: `run` hands a request to an idle one (starting one
    while fewer than `max_children` exist, else waiting) and returns its answer."""

    def __init__(self, max_children: int = MAX_CHILDREN):
        self.max_children = max_children
        self.killed: list[int] = []  # pids of children killed at a time limit, newest last
        self._idle: list[_Child] = []
        self._count = 0
        self._owner = os.getpid()
        self._cond = threading.Condition()

    def run(self, request: dict[str, Any], timeout_s: float) -> dict[str, Any]:
        """The child's answer to `request`; CheckTimeout after `timeout_s` seconds (0: none),
        CheckCrashed when the child died."""
        payload = json.dumps(request, ensure_ascii=True, allow_nan=True).encode()
        child = self._acquire()
        try:
            answer = child.ask(payload, timeout_s)
        except CheckTimeout:
            child.kill()
            self.killed.append(child.pid)
            self._release(None)
            raise
        except BaseException:
            child.kill()
            self._release(None)
            raise
        self._release(child)
        return answer

    def close(self) -> None:
        """Stop the idle children (busy ones are stopped when their check ends)."""
        with self._cond:
            idle, self._idle = self._idle, []
            self._count -= len(idle)
        for child in idle:
            child.kill()

    def _acquire(self) -> _Child:
        with self._cond:
            if os.getpid() != self._owner:  # a forked copy: the children belong to the parent
                self._idle, self._count, self._owner = [], 0, os.getpid()
            while not self._idle and self._count >= self.max_children:
                self._cond.wait()
            if self._idle:
                return self._idle.pop()
            self._count += 1
        try:
            return _Child()
        except BaseException:
            self._release(None)
            raise

    def _release(self, child: _Child | None) -> None:
        with self._cond:
            if child is None:
                self._count -= 1
            else:
                self._idle.append(child)
            self._cond.notify()


CHECKER = SchemaChecker()
atexit.register(CHECKER.close)


def check_in_child(schema: Any, limits: dict[str, int], max_chars: int, max_tokens: int,
                   timeout_s: float) -> dict[str, Any]:
    """`answer(...)` for this schema, computed by a checker child within `timeout_s` (0: none)."""
    return CHECKER.run({"schema": schema, "limits": limits, "max_chars": max_chars, "max_tokens": max_tokens},
                       timeout_s)


def answer(request: dict[str, Any]) -> dict[str, Any]:
    """The check, in the child: {"warnings": [...]} when the schema is usable, else {"limit":
    setting, "problems": [...]}, {"invalid": [...]}, {"recursion": true} or {"failed": type}."""
    from structspec.grammar import GrammarLimits, SchemaError, SchemaLimitExceeded, check_schema
    from structspec.grammar.productive import check_productive

    schema = request["schema"]
    try:
        warnings = check_schema(schema, GrammarLimits(**request["limits"]))
        check_productive(schema, max_chars=request["max_chars"], max_tokens=request["max_tokens"])
        return {"warnings": [str(SchemaError([w])) for w in warnings]}
    except SchemaLimitExceeded as e:
        return {"limit": e.setting, "problems": [p.as_dict() for p in e.problems]}
    except SchemaError as e:
        return {"invalid": [p.as_dict() for p in e.problems]}
    except RecursionError:
        return {"recursion": True}
    except Exception as e:  # a grammar-engine failure on this input; the parent logs it
        import traceback

        traceback.print_exc(file=sys.stderr)
        return {"failed": type(e).__name__}


def main() -> None:
    out = sys.stdout.buffer
    sys.stdout = sys.stderr  # stray prints must not corrupt the answers
    import structspec.grammar  # noqa: F401 - imported before `ready`: not counted in a check's time
    import structspec.grammar.llguidance_backend  # noqa: F401
    import structspec.grammar.productive  # noqa: F401

    out.write(b"ready\n")
    out.flush()
    for line in sys.stdin.buffer:
        out.write(json.dumps(answer(json.loads(line)), ensure_ascii=True).encode() + b"\n")
        out.flush()


if __name__ == "__main__":
    main()
