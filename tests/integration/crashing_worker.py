"""`structspec worker` for the delivery tests: its process kills itself (SIGKILL, as the OOM
killer or a segfault would) in the middle of decoding any document that contains
CRASH_MARKER, taking whatever else is in its engine at that moment with it. Such a document
crashes every worker that runs it.

    python tests/integration/crashing_worker.py [structspec worker options]
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

CRASH_MARKER = "CRASH-THE-WORKER"


def install() -> None:
    from structspec.engine.engine import Engine

    step = Engine.step

    def crashing_step(self: Engine):
        for seq in self.scheduler.running:
            if CRASH_MARKER in seq.request.document and seq.out:  # decoding, beside whatever else runs
                os.kill(os.getpid(), signal.SIGKILL)
        return step(self)

    Engine.step = crashing_step


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    install()
    from structspec.cli import main

    sys.exit(main(["worker", *sys.argv[1:]]))
