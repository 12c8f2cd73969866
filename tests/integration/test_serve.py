"""`structspec serve` end to end: a real uvicorn process on the embedded defaults (SQLite +
SQLAlchemy broker in STRUCTSPEC_DATA_DIR), migrated on start, data kept across restarts."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def serve(data_dir: Path, port: int, log: Path, **settings: str):
    """`structspec serve` on `port`; `settings`: more STRUCTSPEC_* variables (lower-case names)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("STRUCTSPEC_")}
    env.update(STRUCTSPEC_DATA_DIR=str(data_dir), PYTHONPATH=str(ROOT))
    env.update({f"STRUCTSPEC_{k.upper()}": v for k, v in settings.items()})
    with log.open("ab") as out:
        proc = subprocess.Popen([sys.executable, "-m", "structspec.cli", "serve", "--port", str(port)],
                                cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(base, proc, log)
        yield base
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def wait_healthy(base: str, proc: subprocess.Popen, log: Path, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"server exited with {proc.returncode}:\n{log.read_text()}")
        try:
            if httpx.get(f"{base}/health", timeout=5).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    pytest.fail(f"server not healthy within {timeout} s:\n{log.read_text()}")


@pytest.mark.slow
def test_serve_migrates_serves_and_keeps_data_across_restarts(tmp_path):
    data_dir, log, port = tmp_path / "data", tmp_path / "server.log", free_port()
    schema = {"type": "object", "properties": {"title": {"type": "string"}}, "required": ["title"]}

    with serve(data_dir, port, log) as base:
        assert httpx.get(f"{base}/health").json() == {"status": "ok", "database": "ok", "broker": "ok"}
        doc = httpx.get(f"{base}/schema/openapi.json")
        assert doc.status_code == 200 and "/v1/schemas" in doc.json()["paths"]
        r = httpx.post(f"{base}/v1/schemas", json={"name": "article", "schema": schema}, timeout=30)
        assert r.status_code == 201, r.text
        created = r.json()
        big = httpx.post(f"{base}/v1/schemas", content=b" " * (10 * 1024 * 1024),
                         headers={"content-type": "application/json"}, timeout=30)
        assert big.status_code == 413 and big.json()["status_code"] == 413

    assert (data_dir / "structspec.db").exists() and (data_dir / "broker.db").exists()

    with serve(data_dir, port, log) as base:
        r = httpx.get(f"{base}/v1/schemas/by-name/article")
        assert r.status_code == 200, r.text
        assert r.json()["id"] == created["id"] and r.json()["schema"] == schema
