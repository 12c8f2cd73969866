"""`structspec submit` and `structspec batch`: a command-line client of a running server.

Both register the schema file (by content: the same file again reuses its version), send the
work, show a progress bar on stderr until every document is finished, and print results on
stdout. `submit` prints one JSON value per succeeded document, like `extract`; `batch` prints
the server's NDJSON result lines in input order. Either exits 1 if a document did not succeed.

A request that meets a connection error, 429, 502, 503 or 504 is sent again, after the
server's Retry-After or a doubling pause (0.5 s, 1 s, ...; at most 30 s), up to `retries`
times, with a note on stderr. Every POST carries an Idempotency-Key that its retries repeat,
so a submission whose reply was lost is answered with the job or batch it already created,
never run twice (docs/api.md, "Idempotent submission").
"""

from __future__ import annotations

import json
import re
import sys
import uuid
from pathlib import Path
from time import sleep
from typing import Any

import httpx
from tqdm import tqdm

FINISHED = ("succeeded", "failed", "cancelled")


class ClientError(Exception):
    """The server is unreachable or refused the request: printed as one line, exit 2."""


def schema_name(path: str) -> str:
    """A registry name from the file's stem: characters the registry refuses become `_`."""
    stem = re.sub(r"[^A-Za-z0-9._-]", "_", Path(path).stem).strip(".") or "schema"
    return stem[:200]


RETRY_STATUSES = (429, 502, 503, 504)
MAX_PAUSE_S = 30.0


class Client:
    def __init__(self, server: str, timeout: float = 30.0, http: httpx.Client | None = None,
                 api_key: str | None = None, retries: int = 4, backoff_s: float = 0.5):
        """`http` replaces the connection (tests pass Litestar's TestClient, an httpx.Client);
        `api_key` is sent as `Authorization: Bearer <key>`; `retries`: see the module's doc."""
        self.server = server.rstrip("/")
        self._own = http is None
        self.http = http or httpx.Client(base_url=self.server, timeout=timeout)
        self.headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
        self.retries, self.backoff_s = retries, backoff_s

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        if self._own:
            self.http.close()

    def call(self, method: str, path: str, **kw) -> Any:
        """The decoded JSON body; a ClientError naming the server's `detail` and `errors`."""
        headers = {**self.headers, **kw.pop("headers", {})}
        if method == "POST":
            headers.setdefault("idempotency-key", str(uuid.uuid4()))
        pause = self.backoff_s
        for attempt in range(1, self.retries + 2):
            last = attempt > self.retries
            try:
                r = self.http.request(method, path, headers=headers, **kw)
            except httpx.TransportError as e:
                if last:
                    raise ClientError(f"cannot reach the structspec server at {self.server}: {e} "
                                      f"(start one with `structspec serve`, or pass --server)") from None
                why, wait = f"cannot reach the server ({e})", pause
            else:
                if r.status_code not in RETRY_STATUSES or last:
                    break
                why, wait = f"{r.status_code} {_problem(r)}", _retry_after(r, pause)
            wait = min(wait, MAX_PAUSE_S)
            print(f"structspec: {method} {path}: {why}; trying again in {wait:g} s "
                  f"(attempt {attempt + 1} of {self.retries + 1})", file=sys.stderr, flush=True)
            sleep(wait)
            pause *= 2
        if r.status_code >= 400:
            raise ClientError(f"{method} {path}: {r.status_code} {_problem(r)}")
        return r.json() if r.content else None

    def register(self, schema_path: str, schema: dict) -> dict:
        return self.call("POST", "/v1/schemas", json={"name": schema_name(schema_path), "schema": schema})


def _problem(r: httpx.Response) -> str:
    """The API's error body as one line: its detail, then each error item's path and message."""
    try:
        body = r.json()
    except ValueError:
        return r.text[:500]
    if not isinstance(body, dict):
        return r.text[:500]
    items = "; ".join(f"{e.get('path') or ''} {e.get('message')}".strip() for e in body.get("errors") or [])
    return str(body.get("detail") or "") + (f" ({items})" if items else "")


def _retry_after(r: httpx.Response, default: float) -> float:
    try:
        return max(float(r.headers.get("retry-after", "")), 0.0)
    except ValueError:
        return default


def submit(client: Client, schema_id: str, documents: list[tuple[str, str]], options: dict[str, Any],
           show_stats: bool, poll_s: float = 0.5) -> int:
    """One job per document; waits for all; 0 if every one succeeded, else 1."""
    jobs = [client.call("POST", "/v1/extractions",
                        json={"schema_id": schema_id, "document": text, **({"options": options} if options else {})})
            for _, text in documents]
    done: dict[str, dict] = {}
    with tqdm(total=len(jobs), desc="submit", unit="doc", file=sys.stderr) as bar:
        while len(done) < len(jobs):
            for job in jobs:
                if job["id"] not in done:
                    current = client.call("GET", f"/v1/extractions/{job['id']}")
                    if current["status"] in FINISHED:
                        done[job["id"]] = current
                        bar.update(1)
            if len(done) < len(jobs):
                sleep(poll_s)
    failed = 0
    for (path, _), job in zip(documents, jobs):
        res = done[job["id"]]
        if res["status"] == "succeeded":
            print(json.dumps(res["result"], ensure_ascii=False), flush=True)
        else:
            failed += 1
            print(f"structspec: {path}: {res['status']}: {res.get('error')}", file=sys.stderr)
        if show_stats:
            print(json.dumps({"document": path, "id": res["id"], "status": res["status"],
                              **(res.get("stats") or {}), **(res.get("timings") or {})}), file=sys.stderr)
    return 1 if failed else 0


def batch(client: Client, schema_id: str, ndjson: bytes, options: dict[str, Any], poll_s: float = 1.0) -> int:
    """Upload NDJSON as one batch (`options`: job options and webhook_url, sent as query
    parameters); report rejected lines; wait; stream results. 0 if succeeded."""
    params = {"schema_id": schema_id,
              **{k: str(v).lower() if isinstance(v, bool) else str(v) for k, v in options.items()}}
    created = client.call("POST", "/v1/batches", params=params, content=ndjson,
                          headers={"content-type": "application/x-ndjson"})
    for r in created.get("rejected") or []:
        print(f"structspec: line {r.get('line', r.get('index'))} rejected: {r['message']}", file=sys.stderr)
    print(f"structspec: batch {created['id']}: {created['total']} documents", file=sys.stderr, flush=True)
    status = attach(client, created["id"], poll_s)
    return 0 if status == "succeeded" and not created.get("rejected") else 1


def attach(client: Client, batch_id: str, poll_s: float = 1.0) -> str:
    """Wait for a batch with a progress bar, then print its NDJSON results; its final status.
    Interrupted (Ctrl-C), it says how to come back: the batch goes on in the server."""
    try:
        b = client.call("GET", f"/v1/batches/{batch_id}")
        with tqdm(total=b["total"], desc="batch", unit="doc", file=sys.stderr) as bar:
            while True:
                finished = sum(b["counts"].get(s, 0) for s in FINISHED)
                bar.update(finished - bar.n)
                bar.set_postfix({k: v for k, v in b["counts"].items() if v})
                if b["finished_at"] is not None:
                    break
                # the long poll: answered when the batch ends, else after poll_s (the bar's next update)
                b = client.call("GET", f"/v1/batches/{batch_id}", params={"wait": poll_s})
    except KeyboardInterrupt:
        print(f"structspec: batch {batch_id} goes on in the server; `structspec batch --attach {batch_id}` waits "
              f"for it again, POST /v1/batches/{batch_id}/cancel stops it", file=sys.stderr, flush=True)
        raise
    try:
        with client.http.stream("GET", f"/v1/batches/{batch_id}/results", headers=client.headers) as results:
            if results.status_code != 200:
                results.read()
                raise ClientError(f"GET /v1/batches/{batch_id}/results: {results.status_code} {_problem(results)}")
            for line in results.iter_lines():
                if line:
                    print(line, flush=True)
    except httpx.TransportError as e:
        raise ClientError(f"lost the server while reading results of batch {batch_id}: {e}") from None
    print(f"structspec: batch {batch_id}: {b['status']}", file=sys.stderr)
    return b["status"]
