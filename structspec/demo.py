"""`structspec demo`: the whole service on the embedded defaults, end to end.

Starts `structspec serve` and one `structspec worker` as subprocesses (SQLite database and
kombu's SQLAlchemy broker in a temporary directory), registers schemas/contact.json, submits
examples/contact-*.txt as one batch, shows progress on stderr, prints the NDJSON results
(value, source spans, confidence) on stdout and each value's grounding as a table on stderr,
then extracts examples/invoice-azure-interior.pdf and the scan examples/invoice-oyo-scan.png
(read by OCR) with `structspec extract` (each value's page and box; the boxes drawn on the page
in demo-out/overlay/), and stops both processes (also on Ctrl-C, SIGTERM or an error). Each value
is marked right or wrong against examples/<name>.expected.json (structspec/scoring.py), with a
score per document and overall. Exit status 0 once the batch has finished, whatever the model
made of each document (a failed one is explained); 1 when the service itself fails.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from structspec.engine.grounding import leaves
from structspec.layout import checkout
from structspec.layout import data_dir as shipped_dir
from structspec.scoring import ABSENT, Check, score

# Documents the 135M default model reads correctly (most it does not: README, "Quick start").
# The schema asks for verbatim values (x-structspec-verbatim), so every string is a span.
DEMO_SCHEMA, DEMO_DOCUMENTS = "contact.json", "contact-*.txt"
# A PDF and a scan (an image, read by OCR) through `structspec extract`: each string value with the
# page and box it was read from, and those boxes drawn on the page (PNG) so a person can check them.
FILE_SCHEMA, OVERLAY_DIR = "invoice.json", Path("demo-out") / "overlay"
FILE_DOCUMENTS = {"invoice-azure-interior.pdf": "a PDF", "invoice-oyo-scan.png": "a scan (read by OCR)"}
UNITS = {".pdf": "points from the page's top-left corner", ".png": "pixels from the image's top-left corner"}


def demo_examples() -> dict[Path, str]:
    """Each document of examples/ the demo extracts, with the file in schemas/ it uses."""
    batch = {p: DEMO_SCHEMA for p in sorted((shipped_dir("examples")).glob(DEMO_DOCUMENTS))}
    return batch | {shipped_dir("examples") / name: FILE_SCHEMA for name in FILE_DOCUMENTS}


def expected_path(document: Path) -> Path:
    """examples/NAME.expected.json: the values a person reads in examples/NAME.EXT."""
    return document.with_name(f"{document.stem}.expected.json")


class Scores:
    """Each document's checks against its expected values (structspec/scoring.py), as the demo
    prints them: a mark per value, a score per document, and the total."""

    def __init__(self):
        self.by_document: dict[str, list[Check]] = {}

    def check(self, document: Path, schema: dict, result) -> list[Check] | None:
        """The checks of one document's result (ABSENT: none came out); None without an
        expected file."""
        path = expected_path(document)
        if not path.is_file():
            return None
        checks = score(json.loads(path.read_text(encoding="utf-8")), result, schema)
        self.by_document[document.name] = checks
        return checks

    def total(self) -> tuple[int, int]:
        checks = [c for cs in self.by_document.values() for c in cs]
        return sum(c.right for c in checks), len(checks)


def mark(check: Check | None) -> str:
    """✓, or ✗ with what was expected."""
    if check is None or check.expected is ABSENT:
        return "✗ not expected"
    return "✓" if check.right else f"✗ expected {json.dumps(check.expected, ensure_ascii=False)}"


def missing(checks: list[Check]) -> list[Check]:
    """The checks of expected values the result does not have at all."""
    return [c for c in checks if c.actual is ABSENT and c.expected is not ABSENT]


def score_line(name: str, checks: list[Check]) -> str:
    return f"{name}: {sum(c.right for c in checks)}/{len(checks)} values right"


def model_hint(model: str, right: int, total: int) -> list[str]:
    """The overall score, and how to run a bigger model."""
    lines = [f"overall: {right}/{total} values right (against examples/*.expected.json)"]
    if model == "default":
        lines.append("the 135M default model is for trying the service, not for real extraction; bring a bigger "
                     "instruction-tuned model: `structspec demo --model PATH` or STRUCTSPEC_MODEL=PATH make demo "
                     "(a local directory, a .gguf file or an offline Hugging Face id)")
    return lines


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Children:
    """Subprocesses, each in its own process group, all stopped by stop_all(). They import the
    same structspec as this process: a checkout goes first on their PYTHONPATH; an installed
    one is in their interpreter's site-packages."""

    def __init__(self, env: dict[str, str], log_dir: Path):
        self.env, self.log_dir, self.procs = env, log_dir, {}

    def start(self, name: str, *args: str) -> subprocess.Popen:
        with (self.log_dir / f"{name}.log").open("ab") as log:
            proc = subprocess.Popen([sys.executable, "-m", "structspec.cli", *args], cwd=self.log_dir, env=self.env,
                                    stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        self.procs[name] = proc
        return proc

    def check(self) -> None:
        for name, proc in self.procs.items():
            if proc.poll() is not None:
                tail = (self.log_dir / f"{name}.log").read_text(errors="replace")[-3000:]
                raise RuntimeError(f"{name} exited with status {proc.returncode}:\n{tail}")

    def stop_all(self, grace: float = 20) -> None:
        for proc in self.procs.values():
            _signal(proc, signal.SIGTERM)
        deadline = time.monotonic() + grace
        for proc in self.procs.values():
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _signal(proc, signal.SIGKILL)
                proc.wait(timeout=10)


def _signal(proc: subprocess.Popen, sig: int) -> None:
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            pass


def run_demo(args) -> int:
    import httpx

    keep = bool(args.data_dir)
    data_dir = Path(args.data_dir).expanduser() if keep else Path(tempfile.mkdtemp(prefix="structspec-demo-"))
    data_dir.mkdir(parents=True, exist_ok=True)
    port = args.port or free_port()
    env = {k: v for k, v in os.environ.items()
           if k not in ("STRUCTSPEC_DATA_DIR", "STRUCTSPEC_DATABASE_URL", "STRUCTSPEC_BROKER_URL")}
    env.update(STRUCTSPEC_DATA_DIR=str(data_dir),
               PYTHONPATH=os.pathsep.join(filter(None, [str(checkout() or ""), env.get("PYTHONPATH")])),
               HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    if getattr(args, "model", None):  # the worker and `structspec extract` both read it
        env["STRUCTSPEC_MODEL"] = args.model
    model = env.get("STRUCTSPEC_MODEL") or "default"
    scores = Scores()
    children = Children(env, data_dir)
    previous = signal.signal(signal.SIGTERM, raise_interrupt)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + args.timeout
    say = lambda msg: print(f"demo: {msg}", file=sys.stderr, flush=True)  # noqa: E731
    try:
        say(f"data in {data_dir}; starting the API on {base}")
        children.start("server", "serve", "--port", str(port))
        wait_for(lambda: healthy(httpx, base), children, deadline, "the API to become healthy")
        say("starting a worker (loads the model once)")
        children.start("worker", "worker")
        with httpx.Client(base_url=base, timeout=30) as http:
            schema = json.loads((shipped_dir("schemas") / DEMO_SCHEMA).read_text())
            r = http.post("/v1/schemas", json={"name": "contact", "schema": schema})
            r.raise_for_status()
            docs = [{"id": p.name, "document": p.read_text(encoding="utf-8")}
                    for p in sorted(shipped_dir("examples").glob(DEMO_DOCUMENTS))]
            r = http.post("/v1/batches", json={"schema_id": r.json()["id"], "documents": docs})
            r.raise_for_status()
            batch_id = r.json()["id"]
            say(f"batch {batch_id}: {len(docs)} documents")
            last = None

            def progress():
                nonlocal last
                b = http.get(f"/v1/batches/{batch_id}").json()
                line = f"{b['status']} " + " ".join(f"{k}={v}" for k, v in b["counts"].items() if v)
                if line != last:
                    say(line)
                    last = line
                return b["finished_at"] is not None and b

            batch = wait_for(progress, children, deadline, "the batch to finish", interval=0.5)
            with http.stream("GET", f"/v1/batches/{batch_id}/results") as results:
                for line in results.iter_lines():
                    if line:
                        print(line, flush=True)
                        result_line = json.loads(line)
                        checks = scores.check(shipped_dir("examples") / result_line["id"], schema,
                                              result_line["result"] if result_line.get("status") == "succeeded"
                                              else ABSENT)
                        for text in grounding_table(result_line, checks):
                            say(text)
            schema_id = batch["schema_id"]
            stats = http.get(f"/v1/schemas/{schema_id}/stats")
            stats.raise_for_status()
            for line in acceptance_summary(stats.json()):
                say(line)
        for name, what in FILE_DOCUMENTS.items():
            file_demo(shipped_dir("examples") / name, what, env, deadline, say, scores)
        say(f"done: batch {batch['status']}")
        failed = batch["counts"]["failed"] + batch["counts"]["cancelled"]
        if failed:  # the service worked; the model did not get every document right
            say(f"{failed} of {batch['total']} documents failed (the error says why: a loop the guard stopped, "
                "max_tokens, ...)")
        for name, checks in scores.by_document.items():
            say(score_line(name, checks))
        for line in model_hint(model, *scores.total()):
            say(line)
        return 0
    except KeyboardInterrupt:
        say("interrupted")
        return 130
    except Exception as e:
        say(f"error: {e}")
        return 1
    finally:
        say("stopping the worker and the API")
        children.stop_all()
        signal.signal(signal.SIGTERM, previous)
        if not keep:
            shutil.rmtree(data_dir, ignore_errors=True)


def file_demo(path: Path, what: str, env: dict[str, str], deadline: float, say, scores: Scores) -> None:
    """A file of examples/ (a PDF, an image) through `structspec extract --spans --overlay`: each
    value, its page and box, right or wrong, and the overlay PNG written."""
    schema = json.loads((shipped_dir("schemas") / FILE_SCHEMA).read_text())
    say(f"{what}: examples/{path.name} through `structspec extract --verbatim --spans --overlay {OVERLAY_DIR}`")
    run = subprocess.run([sys.executable, "-m", "structspec.cli", "extract",
                          "--schema", str(shipped_dir("schemas") / FILE_SCHEMA),
                          str(path), "--verbatim", "--spans", "--overlay", str(OVERLAY_DIR), "--max-tokens", "200"],
                         env=env, capture_output=True, text=True, timeout=max(deadline - time.monotonic(), 30))
    for line in run.stderr.splitlines():
        if "overlay" in line or "error" in line:
            say(line.removeprefix("structspec: "))
    if run.returncode != 0 or not run.stdout.strip():
        scores.check(path, schema, ABSENT)
        say(f"{path.name} did not come out (exit {run.returncode}): the 135M model often fails on invoices")
        return
    line = json.loads(run.stdout)
    print(run.stdout.strip(), flush=True)
    boxes = line.get("boxes") or {}
    checks = scores.check(path, schema, line["result"])
    by_pointer = {c.pointer: c for c in checks or ()}
    say(f"{path.name}: value, page, box [x0, y0, x1, y1] in {UNITS[path.suffix]}"
        + (", right or wrong" if checks is not None else ""))
    for ptr, value in leaves(line["result"]):
        where = "; ".join(f"page {b['page']} {b['box']}" for b in boxes.get(ptr, [])) or "(no box: not a span)"
        right = f"  {mark(by_pointer.get(ptr))}" if checks is not None else ""
        say(f"  {ptr:<16} {json.dumps(value, ensure_ascii=False):<28} {where:<42}{right}".rstrip())
    if checks is not None:
        for c in missing(checks):
            say(f"  {c.pointer:<16} {'(missing)':<28} {'':<42}  {mark(c)}")
        say(score_line(path.name, checks))
    say("the overlay shows where each value was read")


def grounding_table(line: dict, checks: list[Check] | None = None) -> list[str]:
    """One batch result line's values with their source span and confidence, as text lines; with
    its checks, each value marked right or wrong, the expected values it lacks, and its score."""
    if line.get("status") != "succeeded":
        failed = [f"{line.get('id')}: {line.get('status')}: {line.get('error')}"]
        return failed + [score_line(line.get("id"), checks)] if checks is not None else failed
    spans, confidence = line.get("spans") or {}, line.get("confidence") or {}
    by_pointer = {c.pointer: c for c in checks or ()}
    lines = [f"{line.get('id')}: value, [start, end) in the document, confidence (min/mean token probability)"
             + (", right or wrong" if checks is not None else "")]
    for ptr, value in leaves(line["result"]):
        span = spans.get(ptr)
        where = f"[{span[0]}, {span[1]})" if span else "not in document" if isinstance(value, str) else ""
        conf = confidence.get(ptr)
        sure = f"{conf['min']:.2f}/{conf['mean']:.2f}" if conf else ""
        right = f"  {mark(by_pointer.get(ptr))}" if checks is not None else ""
        lines.append(f"  {ptr:<12} {json.dumps(value, ensure_ascii=False):<36} {where:<16} {sure:<9}{right}".rstrip())
    if checks is not None:
        lines += [f"  {c.pointer:<12} {'(missing)':<36} {'':<16} {'':<9}  {mark(c)}" for c in missing(checks)]
        lines.append(score_line(line.get("id"), checks))
    return lines


def acceptance_summary(stats: dict) -> list[str]:
    """The schema's per-(strategy, k) acceptance as aligned text lines (from /v1/schemas/{id}/stats)."""
    rows = [("strategy", "k", "docs", "tokens", "passes", "accepted", "tokens/pass", "tokens/s")]
    for a in stats["strategies"]:
        rows.append((a["strategy"], str(a["draft_len"]), str(a["requests"]), str(a["output_tokens"]),
                     str(a["target_passes"]), f"{a['acceptance_rate']:.0%}", f"{a['tokens_per_pass']:.2f}",
                     f"{a['tokens_per_second']:.1f}"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["acceptance by strategy (auto picks per document, learning as it goes):"]
    lines += ["  " + "  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows]
    sel = stats.get("selected") or {}
    lines.append(f"auto would now pick: {sel.get('strategy')} k={sel.get('draft_len')}")
    return lines


def raise_interrupt(*_):
    raise KeyboardInterrupt


def healthy(httpx, base: str) -> bool:
    try:
        return httpx.get(f"{base}/health", timeout=5).status_code == 200
    except httpx.TransportError:
        return False


def wait_for(fn, children: Children, deadline: float, what: str, interval: float = 0.2):
    while True:
        value = fn()
        if value:
            return value
        children.check()
        if time.monotonic() > deadline:
            raise TimeoutError(f"gave up waiting for {what}")
        time.sleep(interval)
