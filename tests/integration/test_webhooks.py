"""Batch webhooks (worker/webhooks.py) against a real HTTP receiver on this machine, on SQLite
and PostgreSQL. No worker runs: the jobs are finished by SQL, and the reaper's webhook round
(`deliver_webhooks`) is called directly."""

from __future__ import annotations

import hashlib
import hmac
import json
import socket
import uuid
from dataclasses import replace

import pytest
import sqlalchemy as sa
from litestar.testing import TestClient

from integration_helpers import Receiver, assert_error, id_param
from structspec.api.app import create_app
from structspec.db.jobs import BatchRepository
from structspec.worker import webhooks
from structspec.worker.webhooks import deliver_webhooks

SCHEMA = {"type": "object", "properties": {"total": {"type": "number"}}, "required": ["total"]}
SECRET = "s3cret"
# `make test` runs these on SQLite; on PostgreSQL in `make test-long` (tests/conftest.py)
LONG_PARAMS = {"*": {"database_url": "postgresql"}}


@pytest.fixture
def receiver():
    r = Receiver()
    yield r
    r.close()


@pytest.fixture
def hooked(settings):
    """Settings that allow webhooks to this machine, signed; and a client of them."""
    allowed = replace(settings, webhook_hosts="127.0.0.1, localhost", webhook_secret=SECRET)
    with TestClient(create_app(allowed), raise_server_exceptions=False) as client:
        yield allowed, client


def new_batch(client, url: str, n: int = 2) -> str:
    sid = client.post("/v1/schemas", json={"name": f"hook-{uuid.uuid4().hex[:6]}", "schema": SCHEMA}).json()["id"]
    r = client.post("/v1/batches", json={"schema_id": sid, "webhook_url": url,
                                         "documents": [{"document": f"Total: {i}"} for i in range(n)]})
    assert r.status_code == 202, r.text
    return r.json()["id"]


def finish(sessions, batch_id: str, status: str = "succeeded") -> None:
    with sessions.begin() as s:
        s.execute(sa.text("UPDATE jobs SET status = :st, finished_at = CURRENT_TIMESTAMP WHERE batch_id = :b"),
                  {"st": status, "b": id_param(s, batch_id)})


def make_due(sessions, batch_id: str) -> None:
    """As if the backoff after a failure had passed."""
    with sessions.begin() as s:
        s.execute(sa.update(sa.table("batches", sa.column("id"), sa.column("webhook_next_at")))
                  .where(sa.column("id") == id_param(s, batch_id))
                  .values(webhook_next_at=None))


def test_a_finished_batch_posts_its_webhook_once_signed_with_what_get_answers(hooked, sessions, receiver):
    settings, client = hooked
    batch_id = new_batch(client, receiver.url)
    assert deliver_webhooks(settings, sessions) == 0 and receiver.posts == []  # not finished yet
    finish(sessions, batch_id)
    assert deliver_webhooks(settings, sessions) == 1
    [(headers, body)] = receiver.posts
    assert headers["structspec-signature"] == "sha256=" + hmac.new(SECRET.encode(), body, hashlib.sha256).hexdigest()
    assert headers["content-type"] == "application/json"
    event = json.loads(body)
    assert event["type"] == "batch.finished" and event["delivery"] == batch_id
    assert event["results_url"] == f"/v1/batches/{batch_id}/results"
    now = client.get(f"/v1/batches/{batch_id}").json()
    assert {k: event["batch"][k] for k in ("id", "status", "counts", "total", "finished_at")} == \
        {k: now[k] for k in ("id", "status", "counts", "total", "finished_at")}
    assert event["batch"]["status"] == "succeeded" and event["batch"]["counts"]["succeeded"] == 2
    assert now["webhook"]["url"] == receiver.url and now["webhook"]["attempts"] == 1
    assert now["webhook"]["delivered_at"] is not None and now["webhook"]["error"] is None
    assert deliver_webhooks(settings, sessions) == 0 and len(receiver.posts) == 1  # once


def test_a_failing_url_is_retried_after_a_backoff_and_given_up_after_the_last_try(hooked, sessions, monkeypatch):
    settings, client = hooked
    monkeypatch.setattr(webhooks, "MAX_ATTEMPTS", 3)
    failing = Receiver([500, 503, 502])
    try:
        batch_id = new_batch(client, failing.url)
        finish(sessions, batch_id, "cancelled")
        assert deliver_webhooks(settings, sessions) == 0
        hook = client.get(f"/v1/batches/{batch_id}").json()["webhook"]
        assert hook["attempts"] == 1 and hook["error"] == "HTTP 500: ok" and hook["delivered_at"] is None
        assert deliver_webhooks(settings, sessions) == 0 and len(failing.posts) == 1  # backing off
        for expected in (2, 3):
            make_due(sessions, batch_id)
            deliver_webhooks(settings, sessions)
            assert len(failing.posts) == expected
        make_due(sessions, batch_id)
        assert deliver_webhooks(settings, sessions) == 0 and len(failing.posts) == 3  # no try left
        hook = client.get(f"/v1/batches/{batch_id}").json()["webhook"]
        assert hook["attempts"] == 3 and hook["error"] == "HTTP 502: ok"
        assert json.loads(failing.posts[0][1])["batch"]["status"] == "cancelled"
    finally:
        failing.close()


def test_an_unreachable_url_is_recorded_and_a_try_is_taken_by_one_worker_only(hooked, sessions):
    settings, client = hooked
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    batch_id = new_batch(client, f"http://127.0.0.1:{port}/gone")
    finish(sessions, batch_id)
    assert deliver_webhooks(settings, sessions) == 0
    hook = client.get(f"/v1/batches/{batch_id}").json()["webhook"]
    assert hook["attempts"] == 1 and hook["error"].startswith("ConnectError")
    make_due(sessions, batch_id)
    with sessions.begin() as s:
        assert BatchRepository(s).claim_webhook(uuid.UUID(batch_id), 60)
    with sessions.begin() as s:
        assert not BatchRepository(s).claim_webhook(uuid.UUID(batch_id), 60)  # held by the first


def test_webhook_urls_are_refused_unless_their_host_is_allowed(hooked, client):
    settings, allowed = hooked
    sid = allowed.post("/v1/schemas", json={"name": "r", "schema": SCHEMA}).json()["id"]
    docs = {"schema_id": sid, "documents": [{"document": "x"}]}
    err = assert_error(client.post("/v1/batches", json={**docs, "webhook_url": "http://127.0.0.1/h"}), 422)
    assert "webhooks are off on this server" in err["detail"] and err["errors"][0]["path"] == "/webhook_url"
    for url, why in (("http://example.com/h", "host 'example.com' is not one of STRUCTSPEC_WEBHOOK_HOSTS"),
                     ("ftp://127.0.0.1/h", "must be an http:// or https:// URL"), ("127.0.0.1", "with a host")):
        assert why in assert_error(allowed.post("/v1/batches", json={**docs, "webhook_url": url}), 422)["detail"]
    r = allowed.post(f"/v1/batches?schema_id={sid}&webhook_url=http://evil.test/", content=b'{"document": "x"}\n',
                     headers={"content-type": "application/x-ndjson"})
    assert assert_error(r, 422)["errors"][0] == {"path": "webhook_url", "keyword": None, "source": "query",
                                                 "message": "webhook_url's host 'evil.test' is not one of "
                                                            "STRUCTSPEC_WEBHOOK_HOSTS"}
    r = allowed.post(f"/v1/batches?schema_id={sid}&webhook_url=http://localhost:9/h", content=b'{"document": "x"}\n',
                     headers={"content-type": "application/x-ndjson"})
    assert r.status_code == 202
    assert allowed.get(f"/v1/batches/{r.json()['id']}").json()["webhook"]["url"] == "http://localhost:9/h"
    assert allowed.get("/v1/batches").json()["items"][0]["webhook"]["attempts"] == 0


def test_a_redirect_is_not_followed_and_counts_as_a_failed_try(hooked, sessions, receiver):
    settings, client = hooked
    redirecting = Receiver([302], location=receiver.url)
    try:
        batch_id = new_batch(client, redirecting.url)
        finish(sessions, batch_id)
        assert deliver_webhooks(settings, sessions) == 0
        hook = client.get(f"/v1/batches/{batch_id}").json()["webhook"]
        assert hook["attempts"] == 1 and hook["error"].startswith("HTTP 302") and hook["delivered_at"] is None
        assert len(redirecting.posts) == 1 and receiver.posts == []  # the Location was never called
    finally:
        redirecting.close()


def test_a_receiver_that_does_not_answer_fails_the_try_at_the_timeout(hooked, sessions, monkeypatch):
    import time

    settings, client = hooked
    monkeypatch.setattr(webhooks, "TIMEOUT_S", 0.5)
    stalling = Receiver(stall_s=5)
    try:
        batch_id = new_batch(client, stalling.url)
        finish(sessions, batch_id)
        start = time.monotonic()
        assert deliver_webhooks(settings, sessions) == 0
        assert time.monotonic() - start < 3  # the 0.5 s timeout, not the receiver's 5 s
        hook = client.get(f"/v1/batches/{batch_id}").json()["webhook"]
        assert hook["attempts"] == 1 and hook["error"].startswith("ReadTimeout")
    finally:
        stalling.close()


def test_a_name_that_resolves_to_a_private_address_is_not_called(settings, sessions, receiver, monkeypatch):
    """Under `*` a host name passes at submission; before each POST the worker resolves it, and a
    loopback answer (DNS that changed, or points inside) fails the try with the reason, sending
    nothing."""
    port = int(receiver.url.split(":")[2].split("/")[0])
    starred = replace(settings, webhook_hosts="*")
    real = socket.getaddrinfo
    monkeypatch.setattr(socket, "getaddrinfo", lambda host, *a, **k: real("127.0.0.1" if host == "hooks.test"
                                                                              else host, *a, **k))
    with TestClient(create_app(starred), raise_server_exceptions=False) as client:
        batch_id = new_batch(client, f"http://hooks.test:{port}/hook")
        finish(sessions, batch_id)
        assert deliver_webhooks(starred, sessions) == 0
        hook = client.get(f"/v1/batches/{batch_id}").json()["webhook"]
        assert "'hooks.test' (127.0.0.1) is loopback" in hook["error"], hook
        make_due(sessions, batch_id)
        assert deliver_webhooks(starred, sessions) == 0
        assert receiver.posts == [] and client.get(f"/v1/batches/{batch_id}").json()["webhook"]["attempts"] == 2


# --- DNS: resolved once, every address checked, the connection made to a checked one ----------

PUBLIC = "93.184.216.34"  # a global address; nothing is ever sent to it (see `network`)


class Resolver:
    """socket.getaddrinfo for test names: `answers[name]` lists the answer of each successive
    lookup (the last repeats), each a list of addresses; other names resolve as usual."""

    def __init__(self, real, answers: dict[str, list[list[str]]]):
        self.real, self.answers, self.lookups = real, answers, {name: 0 for name in answers}

    def __call__(self, host, port, *args, **kwargs):
        if host not in self.answers:
            return self.real(host, port, *args, **kwargs)
        answers = self.answers[host]
        addresses = answers[min(self.lookups[host], len(answers) - 1)]
        self.lookups[host] += 1
        return [info for a in addresses for info in self.real(a, port, *args, **kwargs)]


@pytest.fixture
def network(monkeypatch):
    """Outgoing connections (socket.create_connection, which httpx uses) as a private network:
    each connection's address is recorded; PUBLIC refuses; 10.1.2.3 is served by this machine's
    127.0.0.1, so a POST to a 10.x receiver lands in a Receiver. Returns (install resolver, the
    addresses connected to)."""
    real_connect, connected = socket.create_connection, []

    def connect(address, *args, **kwargs):
        host, port = address[:2]
        ip = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][4][0]  # a name: the test's resolver
        connected.append(ip)
        if ip == PUBLIC:
            raise ConnectionRefusedError(111, "Connection refused (the test's public address)")
        return real_connect(("127.0.0.1" if ip == "10.1.2.3" else ip, port), *args, **kwargs)

    monkeypatch.setattr(socket, "create_connection", connect)

    def resolve(answers: dict[str, list[list[str]]]) -> Resolver:
        resolver = Resolver(socket.getaddrinfo, answers)
        monkeypatch.setattr(socket, "getaddrinfo", resolver)
        return resolver

    return resolve, connected


@pytest.mark.parametrize("private", ["127.0.0.1", "10.1.2.3"])
def test_a_name_that_rebinds_to_a_private_address_after_the_check_is_never_posted_to(
        settings, sessions, receiver, network, private):
    """DNS rebinding: the name answers a public address first and a private one from then on.
    The worker resolves once per try and connects to the address it checked, so the private
    answer is never connected to: the first try goes to the public address (refused here), the
    second finds the private answer and is refused naming it."""
    resolve, connected = network
    resolver = resolve({"hooks.test": [[PUBLIC], [private]]})
    starred = replace(settings, webhook_hosts="*")
    with TestClient(create_app(starred), raise_server_exceptions=False) as client:
        batch_id = new_batch(client, f"http://hooks.test:{receiver.port}/hook")
        finish(sessions, batch_id)
        assert deliver_webhooks(starred, sessions) == 0
        assert receiver.posts == [] and connected == [PUBLIC] and resolver.lookups["hooks.test"] == 1
        hook = client.get(f"/v1/batches/{batch_id}").json()["webhook"]
        assert hook["error"].startswith("ConnectError") and f"connecting to {PUBLIC}" in hook["error"], hook
        make_due(sessions, batch_id)
        assert deliver_webhooks(starred, sessions) == 0
        assert receiver.posts == [] and connected == [PUBLIC] and resolver.lookups["hooks.test"] == 2
        hook = client.get(f"/v1/batches/{batch_id}").json()["webhook"]
        kind = "loopback" if private == "127.0.0.1" else "private"
        assert f"'hooks.test' ({private}) is {kind}" in hook["error"] and hook["attempts"] == 2, hook


def test_one_private_address_among_a_names_answers_refuses_the_url(settings, sessions, receiver, network):
    resolve, connected = network
    resolve({"hooks.test": [[PUBLIC, "10.1.2.3"]]})
    starred = replace(settings, webhook_hosts="*")
    with TestClient(create_app(starred), raise_server_exceptions=False) as client:
        batch_id = new_batch(client, f"http://hooks.test:{receiver.port}/hook")
        finish(sessions, batch_id)
        assert deliver_webhooks(starred, sessions) == 0
        hook = client.get(f"/v1/batches/{batch_id}").json()["webhook"]
    assert "'hooks.test' (10.1.2.3) is private" in hook["error"] and connected == [] and receiver.posts == []


def test_the_post_goes_to_the_resolved_address_with_the_urls_host_and_the_next_address_on_a_refusal(
        settings, sessions, receiver, network):
    """A listed name: its addresses are the operator's choice. The connection goes to what the
    one lookup answered, in order (a refused connection sends nothing, so the next is tried),
    with the URL's host in the Host header."""
    resolve, connected = network
    resolver = resolve({"hooks.test": [[PUBLIC, "10.1.2.3"]]})
    listed = replace(settings, webhook_hosts="hooks.test")
    with TestClient(create_app(listed), raise_server_exceptions=False) as client:
        batch_id = new_batch(client, f"http://hooks.test:{receiver.port}/hook")
        finish(sessions, batch_id)
        assert deliver_webhooks(listed, sessions) == 1
    assert connected == [PUBLIC, "10.1.2.3"] and resolver.lookups["hooks.test"] == 1
    [(headers, _)] = receiver.posts
    assert headers["host"] == f"hooks.test:{receiver.port}"


def make_certificate(tmp_path, name: str) -> tuple[str, str, str]:
    """A CA and a certificate for `name` signed by it, made with the openssl command: (CA file,
    certificate file, key file)."""
    import shutil
    import subprocess

    if shutil.which("openssl") is None:
        pytest.skip("the openssl command is not installed")

    def run(*args):
        subprocess.run(["openssl", *args], cwd=tmp_path, check=True, capture_output=True)

    run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.pem", "-days", "2",
        "-subj", "/CN=structspec test CA")
    run("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "host.key", "-out", "host.csr", "-subj", f"/CN={name}")
    (tmp_path / "ext.cnf").write_text(f"subjectAltName=DNS:{name}\n")
    run("x509", "-req", "-in", "host.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
        "-out", "host.pem", "-days", "2", "-extfile", "ext.cnf")
    return str(tmp_path / "ca.pem"), str(tmp_path / "host.pem"), str(tmp_path / "host.key")


@pytest.mark.parametrize("certified", ["hooks.test", "other.test"])
def test_https_to_the_resolved_address_checks_the_certificate_against_the_urls_host(
        settings, sessions, network, monkeypatch, tmp_path, certified):
    """TLS over the pinned connection: SNI and the certificate check name the URL's host, not the
    address: a certificate for it is accepted, one for another name refused."""
    import ssl

    ca, cert, key = make_certificate(tmp_path, certified)
    server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server.load_cert_chain(cert, key)
    names = []
    server.sni_callback = lambda sock, name, ctx: names.append(name)
    monkeypatch.setattr(webhooks, "TLS_VERIFY", ssl.create_default_context(cafile=ca))
    resolve, connected = network
    resolve({"hooks.test": [["127.0.0.1"]]})
    listed = replace(settings, webhook_hosts="hooks.test")
    secure = Receiver(tls=server)
    try:
        with TestClient(create_app(listed), raise_server_exceptions=False) as client:
            batch_id = new_batch(client, f"https://hooks.test:{secure.port}/hook")
            finish(sessions, batch_id)
            delivered = deliver_webhooks(listed, sessions)
            hook = client.get(f"/v1/batches/{batch_id}").json()["webhook"]
    finally:
        secure.close()
    assert connected == ["127.0.0.1"] and names == ["hooks.test"]
    if certified == "hooks.test":
        assert delivered == 1 and hook["error"] is None
        [(headers, _)] = secure.posts
        assert headers["host"] == f"hooks.test:{secure.port}"
    else:
        assert delivered == 0 and secure.posts == []
        assert hook["error"].startswith("ConnectError") and "CERTIFICATE_VERIFY_FAILED" in hook["error"], hook
