"""`python -m bench.flood`: the service under a flood of scans and hostile files.

Starts `structspec serve` + `structspec worker` (bench/load.py's Service: SQLite and the
embedded broker, the default model) and measures, while a thread asks `GET /health` every
0.2 s (its latency is the API's responsiveness throughout):

  1. flood: --clients clients each POST one batch of --per-client scans at once (phone-photo
     sized: the invoices of ../shared/data rendered at 300 dpi with sensor noise, JPEG); each
     submission's latency, then every entry's outcome (succeeded with boxes, or failed with a
     reason) and the time until the last one ends;
  2. hostile: a 1 KB PDF of one 200 x 200 inch page with no text layer (POST ?wait=60: its
     outcome and time) and a 30,000 x 30,000 PNG (its status and time), /health after both;
  3. time limit: a job with options.timeout_s 3 on work that needs minutes, then an ordinary one;
  4. upload: --uploads scans through POST /v1/files, then one batch naming them all by
     file_id: the batch body's size and its submission latency (not waited for);
  5. wrong keys: 300 requests from this client with made-up keys (the statuses, the first 429).

Prints one JSON object (also written to --out). Run it alone: it measures latency on a shared
CPU, and its figures go to docs/benchmarks.md with this command.
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import sys
import threading
import time
from pathlib import Path

from bench import percentile
from bench.hostile import big_page_pdf, png_file
from bench.load import Service, poll_until_finished

ROOT = Path(__file__).resolve().parents[1]
INVOICES = ROOT.parent / "shared" / "data" / "invoices"
FIXTURES = ROOT / "tests" / "fixtures" / "invoices"
SCHEMA = json.loads((ROOT / "schemas" / "invoice.json").read_text())


def scans(n: int, dpi: int = 300, seed: int = 0) -> list[bytes]:
    """n JPEG 'phone photos' of invoice pages: each PDF's first page rendered at `dpi`, with
    Gaussian sensor noise (sigma 6 grey levels): about 2.5 MB each, so two fit one request as
    base64 under the default body limit."""
    import numpy as np
    import pypdfium2 as pdfium
    from PIL import Image

    pdfs = sorted(INVOICES.glob("*.pdf")) or sorted(FIXTURES.glob("*.pdf"))
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        pdf = pdfium.PdfDocument(pdfs[i % len(pdfs)].read_bytes())
        try:
            page = np.asarray(pdf[0].render(scale=dpi / 72).to_pil().convert("RGB"), dtype=np.int16)
        finally:
            pdf.close()
        noisy = np.clip(page + rng.normal(0, 6, page.shape), 0, 255).astype(np.uint8)
        buf = io.BytesIO()
        Image.fromarray(noisy).save(buf, "JPEG", quality=95, dpi=(dpi, dpi))
        out.append(buf.getvalue())
    return out


class HealthProbe:
    """GET /health every `interval` seconds from its own thread; latencies and statuses."""

    def __init__(self, base: str, interval: float = 0.2):
        self.base, self.interval = base, interval
        self.samples: list[tuple[float, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> "HealthProbe":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        import httpx

        with httpx.Client(base_url=self.base, timeout=30) as http:
            while not self._stop.wait(self.interval):
                t0 = time.perf_counter()
                try:
                    status = http.get("/health").status_code
                except httpx.HTTPError:
                    status = 0
                self.samples.append((time.perf_counter() - t0, status))

    def summary(self) -> dict:
        lat = [s for s, _ in self.samples]
        return {"probes": len(lat), "max_s": round(max(lat), 3) if lat else None,
                "p99_s": round(percentile(lat, 99), 3) if lat else None,
                "not_200": sum(1 for _, st in self.samples if st != 200)}


def flood(svc: Service, schema_id: str, clients: int, per_client: int, files: list[bytes]) -> dict:
    bodies = [{"schema_id": schema_id, "documents": [
        {"id": f"c{c}-{k}", "content": base64.b64encode(files[(c * per_client + k) % len(files)]).decode(),
         "media_type": "image/jpeg"} for k in range(per_client)]} for c in range(clients)]
    answers: list[dict] = [{} for _ in range(clients)]
    go = threading.Barrier(clients)

    def submit(c: int) -> None:
        go.wait()
        t0 = time.perf_counter()
        r = svc.http.post("/v1/batches", json=bodies[c])
        answers[c] = {"status_code": r.status_code, "latency_s": round(time.perf_counter() - t0, 3),
                      "batch": r.json() if r.status_code == 202 else r.text[:300]}

    started = time.monotonic()
    threads = [threading.Thread(target=submit, args=(c,)) for c in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    outcomes = []
    for a in answers:
        if a["status_code"] != 202:
            continue
        batch = a["batch"]["id"]
        while svc.http.get(f"/v1/batches/{batch}?wait=30").json()["finished_at"] is None:
            svc.children.check()
        lines = [json.loads(x) for x in svc.http.get(f"/v1/batches/{batch}/results").text.splitlines()]
        outcomes += [{"status": x["status"], "boxes": bool(x.get("boxes")),
                      "spans_found": sum(v is not None for v in (x.get("spans") or {}).values()),
                      "error": (x.get("error") or "")[:160] or None} for x in lines]
    return {"clients": clients, "per_client": per_client, "file_mb": [round(len(f) / 2**20, 2) for f in files],
            "submissions": [{k: a[k] for k in ("status_code", "latency_s")} for a in answers],
            "max_submission_s": max(a["latency_s"] for a in answers),
            "entries": len(outcomes), "succeeded": sum(o["status"] == "succeeded" for o in outcomes),
            "succeeded_with_boxes": sum(o["status"] == "succeeded" and o["boxes"] for o in outcomes),
            # a value gets a box where it is found in the document's text: none found, none to draw
            "succeeded_no_value_found": sum(o["status"] == "succeeded" and not o["spans_found"] for o in outcomes),
            "failed": [o["error"] for o in outcomes if o["status"] == "failed"],
            "all_done_s": round(time.monotonic() - started, 1)}


def hostile(svc: Service, schema_id: str) -> dict:
    out = {}
    for name, data, kind in (("page_200_inches", big_page_pdf(), "application/pdf"),
                             ("png_30000", png_file(30_000, 30_000), "image/png")):
        t0 = time.perf_counter()
        r = svc.http.post("/v1/extractions?wait=60", json={"schema_id": schema_id, "media_type": kind,
                                                          "content": base64.b64encode(data).decode()})
        body = r.json()
        if r.status_code == 202:  # not finished within the wait: follow it
            body = poll_until_finished(svc.http, [body["id"]], time.monotonic() + 120, svc.children.check)[body["id"]]
        out[name] = {"file_bytes": len(data), "status_code": r.status_code, "s": round(time.perf_counter() - t0, 2),
                     "job_status": body.get("status"), "error": (body.get("error") or body.get("detail") or "")[:300],
                     "warnings": body.get("warnings")}
    t0 = time.perf_counter()
    out["health_after"] = {"status_code": svc.http.get("/health").status_code, "s": round(time.perf_counter() - t0, 3)}
    return out


def upload(svc: Service, schema_id: str, files: list[bytes], n: int) -> dict:
    ids, t0 = [], time.perf_counter()
    for i in range(n):
        r = svc.http.post("/v1/files", files={"file": (f"scan-{i}.jpg", files[i % len(files)], "image/jpeg")})
        r.raise_for_status()
        ids.append(r.json()["id"])
    uploaded_s = time.perf_counter() - t0
    body = {"schema_id": schema_id, "documents": [{"id": i, "file_id": f} for i, f in enumerate(ids)]}
    t0 = time.perf_counter()
    r = svc.http.post("/v1/batches", json=body)
    return {"uploads": n, "upload_s": round(uploaded_s, 2), "batch_body_bytes": len(json.dumps(body)),
            "batch_status_code": r.status_code, "batch_submission_s": round(time.perf_counter() - t0, 3),
            "batch_total": r.json().get("total") if r.status_code == 202 else r.text[:300]}


def time_limit(svc: Service, schema_id: str) -> dict:
    """A job with options.timeout_s 3 on work that needs minutes (an array of 3000 integers, up to
    8000 tokens), then an ordinary job: when and how the first ends, and that the second succeeds."""
    long = {"type": "object", "properties": {"n": {"type": "array", "minItems": 3000, "items": {"type": "integer"}}},
            "required": ["n"]}
    t0 = time.perf_counter()
    r = svc.http.post("/v1/extractions?wait=60", json={"schema": long, "document": "Count from 1 to 3000.",
                                                      "options": {"timeout_s": 3, "max_tokens": 8000}})
    job = r.json()
    if r.status_code == 202:
        job = poll_until_finished(svc.http, [job["id"]], time.monotonic() + 120, svc.children.check)[job["id"]]
    ended_s = time.perf_counter() - t0
    total = {"type": "object", "properties": {"total": {"type": "number"}}, "required": ["total"]}
    r = svc.http.post("/v1/extractions?wait=60", json={"schema": total, "options": {"max_tokens": 32},
                                                      "document": "Invoice 7 from ACME, total 12.50 EUR."})
    nxt = r.json()
    return {"status": job.get("status"), "error": job.get("error"), "ended_after_s": round(ended_s, 2),
            "next_job": {k: nxt.get(k) for k in ("status", "result", "error")}}


def wrong_keys(base: str, n: int = 300) -> dict:
    """n requests from one client, each with a different made-up key: the statuses, and the first 429."""
    import uuid

    import httpx

    statuses = []
    with httpx.Client(base_url=base, timeout=30) as http:
        for _ in range(n):
            statuses.append(http.get("/v1/schemas", headers={"authorization": f"Bearer ss_{uuid.uuid4().hex}"})
                            .status_code)
    first = next((i + 1 for i, st in enumerate(statuses) if st == 429), None)
    return {"requests": n, "401": statuses.count(401), "429": statuses.count(429), "first_429_at": first}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.flood", description=__doc__.split("\n\n")[0])
    p.add_argument("--clients", type=int, default=6)
    p.add_argument("--per-client", type=int, default=2)
    p.add_argument("--uploads", type=int, default=50)
    p.add_argument("--out", type=Path, default=Path("bench-out/flood.json"))
    args = p.parse_args(argv)
    say = lambda msg: print(f"bench flood: {msg}", file=sys.stderr, flush=True)  # noqa: E731
    files = scans(args.clients * args.per_client)
    say(f"{len(files)} scans of {min(len(f) for f in files) / 2**20:.1f}-{max(len(f) for f in files) / 2**20:.1f} MB")
    report: dict = {}
    with Service(say=say) as svc:  # default settings: two scans fit the 8 MiB body limit as base64
        schema_id = svc.http.post("/v1/schemas", json={"name": "invoice", "schema": SCHEMA}).json()["id"]
        svc.run_one(schema_id, "Invoice 1 from ACME, total 10.00 USD, 2024-01-02.", {"max_tokens": 32})  # warm
        with HealthProbe(svc.base) as probe:
            say("flood")
            report["flood"] = flood(svc, schema_id, args.clients, args.per_client, files)
            report["health_during_flood"] = probe.summary()
        say("hostile files")
        report["hostile"] = hostile(svc, schema_id)
        say("a job past its time limit")
        report["time_limit"] = time_limit(svc, schema_id)
        say("uploads")
        report["upload"] = upload(svc, schema_id, files, args.uploads)
        say("wrong keys (last: the address is then refused for a while, this client included)")
        report["wrong_keys"] = wrong_keys(svc.base)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
