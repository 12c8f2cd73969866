"""/health: 200 when database and broker answer; 503 naming the failing one, quickly."""

from __future__ import annotations

import dataclasses
import time

from litestar.testing import TestClient

from structspec.api.app import create_app


# `make test` runs these on SQLite; on PostgreSQL in `make test-long` (tests/conftest.py)
LONG_PARAMS = {"*": {"database_url": "postgresql"}}


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


# --- a flood of probes: what they read is cached for a second per process ----------------------

class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def count_statements(engine) -> list[str]:
    """Every SQL statement `engine` sends from now on."""
    from sqlalchemy import event

    sent: list[str] = []
    event.listen(engine, "before_cursor_execute", lambda conn, cursor, statement, *a: sent.append(statement))
    return sent


def test_a_flood_of_health_probes_checks_once_a_second_and_a_down_database_shows_after_it(client):
    clock = Clock()
    health = client.app.state.health
    health.cache.clock = clock
    sent = count_statements(client.app.state.engine)
    assert client.get("/health").status_code == 200
    one_check = len(sent)
    assert one_check > 0
    assert {client.get("/health").status_code for _ in range(50)} == {200}
    assert len(sent) == one_check  # 50 probes within the second: no further query

    def down():
        raise RuntimeError("the database went away")

    health._check_database = down
    clock.now += 0.5
    assert client.get("/health").status_code == 200  # the report of half a second ago
    clock.now += 0.5  # a second after the last check: checked again
    r = client.get("/health")
    assert r.status_code == 503 and r.json()["database"] == "error: the database went away", r.text


def test_a_flood_of_scrapes_reads_the_metrics_once_a_second(client):
    clock = Clock()
    client.app.state.metrics_cache.clock = clock
    sent = count_statements(client.app.state.engine)
    first = client.get("/metrics")
    assert first.status_code == 200
    one_scrape = len(sent)
    assert one_scrape > 0
    assert all(client.get("/metrics").text == first.text for _ in range(50))
    assert len(sent) == one_scrape
    clock.now += 1.0
    assert client.get("/metrics").status_code == 200 and len(sent) == 2 * one_scrape
