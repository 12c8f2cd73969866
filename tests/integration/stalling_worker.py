"""`structspec worker` for the time-limit tests: its engine stalls on marked documents.

- HANG_MARKER: once such a document is decoding, Engine.step never returns (as a hung kernel
  or a deadlocked step would), with whatever else is in the engine at that moment.
- SLOW_MARKER: every step taken while such a document runs lasts SLOW_STEP_S longer, so the
  document needs far longer than a short time limit.

    python tests/integration/stalling_worker.py [structspec worker options]
"""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

HANG_MARKER = "HANG-THE-ENGINE"
SLOW_MARKER = "SLOW-THE-ENGINE"
SLOW_STEP_S = 0.5


def install() -> None:
    from structspec.engine.engine import Engine

    step = Engine.step

    def stalling_step(self: Engine):
        running = self.scheduler.running
        if any(HANG_MARKER in seq.request.document and seq.out for seq in running):
            threading.Event().wait()  # never set: this step never returns
        if any(SLOW_MARKER in seq.request.document for seq in running):
            time.sleep(SLOW_STEP_S)
        return step(self)

    Engine.step = stalling_step


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    install()
    from structspec.cli import main

    sys.exit(main(["worker", *sys.argv[1:]]))
