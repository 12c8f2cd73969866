"""Helpers for the job/worker tests: a tiny random-weight Llama, worker subprocesses, and
bounded polling. Every wait has a deadline; every subprocess is killed in a finally."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import sqlalchemy as sa

from structspec.config import Settings
from structspec.db.session import make_engine

ROOT = Path(__file__).resolve().parents[2]

# Enums and booleans only: even random weights finish in a handful of tokens and validly.
TINY_SCHEMA = {"type": "object",
               "properties": {"label": {"enum": ["a", "b", "c"]}, "ok": {"type": "boolean"}},
               "required": ["label", "ok"]}


def build_tiny_model(directory: Path) -> Path:
    """A 2-layer, 64-wide random Llama with the default model's tokenizer (~7 MB)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from structspec.engine.model import load_tokenizer

    tok = load_tokenizer()
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=8192,
        tie_word_embeddings=False, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id))
    model.save_pretrained(directory)
    tok.save_pretrained(directory)
    return directory


def worker_env(settings: Settings, model: str | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("STRUCTSPEC_")}
    env.update(PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
               STRUCTSPEC_DATA_DIR=str(settings.data_dir), STRUCTSPEC_DATABASE_URL=settings.database_url,
               STRUCTSPEC_BROKER_URL=settings.broker_url, STRUCTSPEC_JOB_LEASE_S=str(settings.job_lease_s),
               STRUCTSPEC_JOB_QUEUE=settings.job_queue, STRUCTSPEC_TORCH_THREADS="1",
               STRUCTSPEC_JOB_MAX_ATTEMPTS=str(settings.job_max_attempts),
               STRUCTSPEC_ENGINE_MAX_SEQS=str(settings.engine_max_seqs),
               STRUCTSPEC_JOB_REPUBLISH_AFTER_S=str(settings.job_republish_after_s),
               STRUCTSPEC_JOB_TIMEOUT_S=str(settings.job_timeout_s),
               STRUCTSPEC_ENGINE_WATCHDOG_S=str(settings.engine_watchdog_s),
               STRUCTSPEC_LOG_FORMAT=settings.log_format, STRUCTSPEC_WEBHOOK_SECRET=settings.webhook_secret,
               STRUCTSPEC_WEBHOOK_HOSTS=settings.webhook_hosts, STRUCTSPEC_JSON_WHITESPACE=settings.json_whitespace)
    if model is not None:
        env["STRUCTSPEC_MODEL"] = model
    return env


@dataclass
class Worker:
    """`structspec worker` as a subprocess in its own process group."""

    settings: Settings
    model: str | None
    log: Path
    args: tuple[str, ...] = ()  # more `structspec worker` options
    script: Path | None = None  # a script that runs `structspec worker` with a fault hook (crashing_worker.py)
    proc: subprocess.Popen | None = field(default=None)

    def start(self) -> "Worker":
        command = [str(self.script)] if self.script else ["-m", "structspec.cli", "worker"]
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen([sys.executable, *command, *self.args], cwd=ROOT,
                                         env=worker_env(self.settings, self.model), stdout=out,
                                         stderr=subprocess.STDOUT, start_new_session=True)
        return self

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Signal the whole group (one process: the engine and its task threads) and reap it."""
        if self.proc is None or self.proc.poll() is not None:
            return
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:
            pass
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)

    def stop(self) -> None:
        self.kill(signal.SIGTERM)

    def pause(self, paused: bool = True) -> None:
        """SIGSTOP the whole group (it does nothing more until resumed; SIGKILL still ends it), or
        SIGCONT it."""
        os.killpg(self.proc.pid, signal.SIGSTOP if paused else signal.SIGCONT)

    def children(self) -> list[int]:
        """Pids of the worker's child processes (the prefork pool's)."""
        out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(self.proc.pid)], capture_output=True, text=True)
        return [int(x) for x in out.stdout.split()]

    def check_alive(self) -> None:
        if self.proc is not None and self.proc.poll() is not None:
            pytest.fail(f"worker exited with {self.proc.returncode}:\n{self.log.read_text()[-4000:]}")


def poll(fn, *, timeout: float, interval: float = 0.25, what: str = "condition", worker: Worker | None = None):
    """Call fn() until it returns something truthy; fail after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = fn()
        if value:
            return value
        if worker is not None:
            worker.check_alive()
        if time.monotonic() > deadline:
            log = f"\nworker log:\n{worker.log.read_text()[-4000:]}" if worker is not None else ""
            pytest.fail(f"timed out after {timeout} s waiting for {what}{log}")
        time.sleep(interval)


def query(database_url: str, sql: str, **params) -> list:
    """Rows of `sql` on its own short-lived connection (the app's pool is left alone)."""
    engine = make_engine(database_url)
    try:
        with engine.connect() as conn:
            return conn.execute(sa.text(sql), params).all()
    finally:
        engine.dispose()
