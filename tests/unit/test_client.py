"""The command-line client's HTTP behaviour (structspec/client.py) against a scripted server
(httpx.MockTransport): retries, the Idempotency-Key its retries repeat, and error lines."""

from __future__ import annotations

import httpx
import pytest

from structspec import client as client_module
from structspec.client import Client, ClientError


def scripted(*answers):
    """A transport answering each request with the next of `answers` (an httpx.Response, or an
    exception to raise: KeyboardInterrupt too), recording the requests."""
    seen: list[httpx.Request] = []
    queue = list(answers)

    def handle(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        answer = queue.pop(0)
        if isinstance(answer, BaseException):
            raise answer
        return answer

    return httpx.Client(base_url="http://server", transport=httpx.MockTransport(handle)), seen


def error(status: int, detail: str, headers: dict | None = None) -> httpx.Response:
    return httpx.Response(status, json={"status_code": status, "detail": detail, "errors": []}, headers=headers)


@pytest.fixture(autouse=True)
def no_sleep(monkeypatch):
    pauses: list[float] = []
    monkeypatch.setattr(client_module, "sleep", pauses.append)  # the client's own, not time.sleep: other threads sleep too
    return pauses


def test_a_post_is_retried_through_lost_connections_and_503_with_one_idempotency_key(no_sleep, capsys):
    http, seen = scripted(httpx.ConnectError("refused"), error(503, "the database is unavailable; retry later",
                                                                 {"retry-after": "5"}),
                          httpx.Response(202, json={"id": "j1", "status": "queued"}))
    with Client("http://server", http=http) as c:
        assert c.call("POST", "/v1/extractions", json={"document": "d"}) == {"id": "j1", "status": "queued"}
    keys = {r.headers["idempotency-key"] for r in seen}
    assert len(seen) == 3 and len(keys) == 1 and len(keys.pop()) == 36
    assert no_sleep == [0.5, 5.0]  # doubling pause, then the server's Retry-After
    err = capsys.readouterr().err
    assert "cannot reach the server" in err and "trying again in 0.5 s (attempt 2 of 5)" in err
    assert "503 the database is unavailable; retry later; trying again in 5 s (attempt 3 of 5)" in err


def test_each_post_has_its_own_key_and_gets_are_sent_without_one():
    http, seen = scripted(*(httpx.Response(202, json={}) for _ in range(3)))
    with Client("http://server", http=http) as c:
        c.call("POST", "/v1/extractions", json={})
        c.call("POST", "/v1/extractions", json={})
        c.call("GET", "/v1/extractions/x")
    assert seen[0].headers["idempotency-key"] != seen[1].headers["idempotency-key"]
    assert "idempotency-key" not in seen[2].headers


def test_retries_end_with_the_last_answer_named(no_sleep):
    http, seen = scripted(*(error(429, "too many requests", {"retry-after": "120"}) for _ in range(3)))
    with Client("http://server", http=http, retries=2) as c, pytest.raises(ClientError) as e:
        c.call("GET", "/v1/batches/b")
    assert len(seen) == 3 and no_sleep == [30.0, 30.0]  # Retry-After capped at 30 s
    assert str(e.value) == "GET /v1/batches/b: 429 too many requests"


def test_a_client_error_is_not_retried_and_names_the_detail_and_items(no_sleep):
    body = {"status_code": 422, "detail": "invalid option: draft_len",
            "errors": [{"path": "/options/draft_len", "message": "must be at most 64", "keyword": None,
                        "source": "body"}]}
    http, seen = scripted(httpx.Response(422, json=body), error(404, "no schema with id 5"))
    with Client("http://server", http=http) as c:
        with pytest.raises(ClientError, match=r"^POST /v1/extractions: 422 invalid option: draft_len "
                                              r"\(/options/draft_len must be at most 64\)$"):
            c.call("POST", "/v1/extractions", json={})
        with pytest.raises(ClientError, match=r"^GET /v1/schemas/5: 404 no schema with id 5$"):
            c.call("GET", "/v1/schemas/5")
    assert len(seen) == 2 and no_sleep == []


def test_an_unreachable_server_is_named_after_the_retries(no_sleep):
    http, seen = scripted(*(httpx.ConnectError("refused") for _ in range(2)))
    with Client("http://server", http=http, retries=1) as c, pytest.raises(ClientError,
                                                                        match="cannot reach the structspec server"):
        c.call("GET", "/v1/schemas")
    assert len(seen) == 2 and no_sleep == [0.5]


def batch_state(done: int, total: int = 2, finished: bool = False) -> httpx.Response:
    return httpx.Response(200, json={"id": "b1", "total": total, "status": "succeeded" if finished else "running",
                                     "counts": {"queued": total - done, "succeeded": done},
                                     "finished_at": "2026-11-24T00:00:00Z" if finished else None})


def test_attach_waits_for_a_batch_and_prints_its_results_with_the_key(no_sleep, capsys):
    lines = b'{"id": 0, "status": "succeeded"}\n{"id": 1, "status": "succeeded"}\n'
    http, seen = scripted(batch_state(1), batch_state(2, finished=True), httpx.Response(200, content=lines))
    with Client("http://server", http=http, api_key="ss_k") as c:
        assert client_module.attach(c, "b1", poll_s=0.25) == "succeeded"
    out, err = capsys.readouterr()
    assert out.splitlines() == [line.decode() for line in lines.splitlines()]
    # the second read is the API's long poll (answered as the batch ends, or after poll_s): no sleep here
    assert "batch b1: succeeded" in err and no_sleep == []
    assert [r.url.path for r in seen] == ["/v1/batches/b1"] * 2 + ["/v1/batches/b1/results"]
    assert dict(seen[0].url.params) == {} and dict(seen[1].url.params) == {"wait": "0.25"}
    assert all(r.headers["authorization"] == "Bearer ss_k" for r in seen)  # the results stream too


def test_attach_names_a_refused_results_stream_and_an_interrupted_wait_says_how_to_come_back(capsys):
    http, _ = scripted(batch_state(2, finished=True), error(401, "invalid API key"))
    with Client("http://server", http=http) as c, pytest.raises(ClientError,
                                                                match="results: 401 invalid API key"):
        client_module.attach(c, "b1")

    http, _ = scripted(batch_state(0), KeyboardInterrupt())  # Ctrl-C during the long poll
    with Client("http://server", http=http) as c, pytest.raises(KeyboardInterrupt):
        client_module.attach(c, "b1")
    assert "batch b1 goes on in the server; `structspec batch --attach b1` waits for it again" in \
        capsys.readouterr().err


def test_batch_sends_its_options_and_webhook_url_as_query_parameters(no_sleep, capsys):
    created = httpx.Response(202, json={"id": "b1", "total": 2, "rejected": []})
    http, seen = scripted(created, batch_state(2, finished=True), httpx.Response(200, content=b""))
    with Client("http://server", http=http) as c:
        assert client_module.batch(c, "s1", b'{"document": "x"}\n',
                                   {"max_tokens": 64, "verbatim": True, "webhook_url": "https://hooks.test/b"}) == 0
    params = dict(seen[0].url.params)
    assert params == {"schema_id": "s1", "max_tokens": "64", "verbatim": "true", "webhook_url": "https://hooks.test/b"}
    assert seen[0].headers["content-type"] == "application/x-ndjson" and "idempotency-key" in seen[0].headers
