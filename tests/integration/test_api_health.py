"""/health: 200 when database and broker answer; 503 naming the failing one, quickly."""

from __future__ import annotations

import dataclasses
import time

from litestar.testing import TestClient

from structspec.api.app import create_app


def health(settings):
    with TestClient(create_app(settings), raise_server_exceptions=False) as c:
        start = time.monotonic()
        r = c.get("/health")
        return r, time.monotonic() - start


def test_health_is_ok_with_the_embedded_broker(client):
    r = client.get("/health")
    assert r.status_code == 200, r.text
    assert r.json() == {"status": "ok", "database": "ok", "broker": "ok"}


def test_health_is_ok_with_redis(settings, redis_url):
    r, _ = health(dataclasses.replace(settings, broker_url=redis_url))
    assert r.status_code == 200, r.text


def test_health_is_ok_with_rabbitmq(settings, amqp_url):
    r, _ = health(dataclasses.replace(settings, broker_url=amqp_url))
    assert r.status_code == 200, r.text


def test_unreachable_broker_is_503_naming_the_broker_within_seconds(settings):
    r, elapsed = health(dataclasses.replace(settings, broker_url="redis://127.0.0.1:1/0"))
    assert r.status_code == 503, r.text
    body = r.json()
    assert body["status"] == "error" and body["database"] == "ok"
    assert body["broker"].startswith("error: ")
    assert body["status_code"] == 503 and "broker" in body["detail"]
    assert [e["source"] for e in body["errors"]] == ["broker"]
    assert elapsed < 5


def test_unreachable_database_is_503_naming_the_database_within_seconds(settings):
    r, elapsed = health(dataclasses.replace(settings, database_url="postgresql://nobody@127.0.0.1:1/none"))
    assert r.status_code == 503, r.text
    body = r.json()
    assert body["database"].startswith("error: ") and body["broker"] == "ok"
    assert "database" in body["detail"]
    assert elapsed < 5


def test_unmigrated_database_is_503_saying_to_migrate(settings, tmp_path):
    r, _ = health(dataclasses.replace(settings, database_url=f"sqlite:///{tmp_path / 'blank.db'}"))
    assert r.status_code == 503
    assert "structspec migrate" in r.json()["database"]


def test_embedded_broker_that_cannot_open_its_file_is_503(settings, tmp_path):
    (tmp_path / "not-a-dir").write_text("")
    r, _ = health(dataclasses.replace(settings, broker_url=f"sqla+sqlite:///{tmp_path / 'not-a-dir' / 'broker.db'}"))
    assert r.status_code == 503, r.text
    assert r.json()["broker"].startswith("error: ")
