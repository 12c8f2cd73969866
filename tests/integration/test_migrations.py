"""Alembic revisions: upgrade from empty and downgrade to base on SQLite and PostgreSQL, and
the ORM models agree with what the migrations build."""

from __future__ import annotations

import dataclasses

import pytest
import sqlalchemy as sa
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext

from structspec.db import migrate
from structspec.db.models import Base
from structspec.db.session import make_engine


def table_names(url: str) -> set[str]:
    engine = make_engine(url)
    try:
        return set(sa.inspect(engine).get_table_names())
    finally:
        engine.dispose()


def test_upgrade_from_empty_creates_tables_and_downgrade_to_base_removes_them(empty_database_url):
    url = empty_database_url
    assert "schemas" not in table_names(url)

    migrate.upgrade(url)
    assert {"schemas", "alembic_version"} <= table_names(url)
    assert migrate.current_revision(url) == migrate.head_revision()

    migrate.downgrade(url, "base")
    assert "schemas" not in table_names(url)
    assert migrate.current_revision(url) is None

    migrate.upgrade(url, "head")  # and back up again, cleanly
    assert "schemas" in table_names(url)


def test_migrated_database_matches_the_orm_models(empty_database_url):
    migrate.upgrade(empty_database_url)
    engine = make_engine(empty_database_url)
    try:
        with engine.connect() as conn:
            diff = compare_metadata(MigrationContext.configure(conn, opts={"compare_type": True}), Base.metadata)
    finally:
        engine.dispose()
    assert diff == [], f"models and migrations disagree; add a revision: {diff}"


def test_schemas_table_enforces_unique_name_and_version(empty_database_url):
    migrate.upgrade(empty_database_url)
    engine = make_engine(empty_database_url)
    insert = sa.text("INSERT INTO schemas (id, name, version, body, hash, created_at, updated_at) "
                     "VALUES (:id, 'n', 1, '{}', 'h', CURRENT_TIMESTAMP, CURRENT_TIMESTAMP)")
    try:
        with engine.begin() as conn:
            conn.execute(insert, {"id": "0" * 32})
        try:
            with engine.begin() as conn:
                conn.execute(insert, {"id": "1" * 32})
        except sa.exc.IntegrityError:
            pass
        else:
            raise AssertionError("a second (name, version) row was accepted")
    finally:
        engine.dispose()


def test_widening_the_stats_strategy_keeps_every_row(empty_database_url):
    """0004 rebuilds the stats tables on SQLite; no row may be lost to the cascading foreign key."""
    url = empty_database_url
    migrate.upgrade(url, "0003")
    engine = make_engine(url)
    sid = "0" * 32 if url.startswith("sqlite") else "00000000-0000-0000-0000-000000000000"
    arm = ("INSERT INTO schema_arm_stats (schema_id, strategy, draft_len, requests, output_tokens, target_passes, "
           "proposed, accepted, decode_s, latency_s_sum, latency_buckets, d_requests, d_passes, d_decode_s, "
           "seen_at, updated_at) VALUES (:sid, :s, 4, 1, 10, 3, 8, 7, 0.5, 0.6, '[]', 1, 3, 0.5, 1, CURRENT_TIMESTAMP)")
    pos = ("INSERT INTO schema_position_stats (schema_id, strategy, draft_len, position, proposed, accepted, d_accepted) "
           "VALUES (:sid, :s, 4, :p, 3, 2, 2)")
    counts = "SELECT (SELECT count(*) FROM schema_arm_stats), (SELECT count(*) FROM schema_position_stats)"
    try:
        with engine.begin() as conn:
            conn.execute(sa.text("INSERT INTO schemas (id, name, version, body, hash, created_at, updated_at) "
                                 "VALUES (:sid, 'n', 1, '{}', 'h', CURRENT_TIMESTAMP, CURRENT_TIMESTAMP)"), {"sid": sid})
            conn.execute(sa.text(arm), {"sid": sid, "s": "ngram"})
            for p in range(4):
                conn.execute(sa.text(pos), {"sid": sid, "s": "ngram", "p": p})
        engine.dispose()
        migrate.upgrade(url, "0004")
        with engine.begin() as conn:
            assert tuple(conn.execute(sa.text(counts)).one()) == (1, 4)
            conn.execute(sa.text(arm), {"sid": sid, "s": "composite+verbatim"})  # 18 characters now fit
            conn.execute(sa.text(pos), {"sid": sid, "s": "composite+verbatim", "p": 0})
        engine.dispose()
        migrate.downgrade(url, "0003")  # verbatim arms go, the rest stays
        with engine.begin() as conn:
            assert tuple(conn.execute(sa.text(counts)).one()) == (1, 4)
    finally:
        engine.dispose()


def test_tenants_migration_keeps_every_row_and_scopes_versions_by_tenant(empty_database_url):
    """0005 rebuilds `schemas` on SQLite (new unique constraint), which jobs, batches and stats
    reference: with foreign keys on, the copy's DROP would delete or refuse them."""
    url = empty_database_url
    migrate.upgrade(url, "0004")
    engine = make_engine(url)
    sqlite = url.startswith("sqlite")
    ids = [("%d" % i) * 32 if sqlite else f"0000000{i}-0000-0000-0000-000000000000" for i in range(1, 5)]
    sid, bid, jid, sid2 = ids
    schema = ("INSERT INTO schemas (id, {tenant}name, version, body, hash, created_at, updated_at) "
              "VALUES (:id, {value}'n', 1, '{{}}', 'h', CURRENT_TIMESTAMP, CURRENT_TIMESTAMP)")
    counts = ("SELECT (SELECT count(*) FROM schemas), (SELECT count(*) FROM batches), (SELECT count(*) FROM jobs), "
              "(SELECT count(*) FROM schema_arm_stats), (SELECT count(*) FROM schema_position_stats)")
    try:
        with engine.begin() as conn:
            conn.execute(sa.text(schema.format(tenant="", value="")), {"id": sid})
            conn.execute(sa.text("INSERT INTO batches (id, schema_id, total, options, created_at) "
                                 "VALUES (:id, :sid, 1, '{}', CURRENT_TIMESTAMP)"), {"id": bid, "sid": sid})
            conn.execute(sa.text("INSERT INTO jobs (id, schema_id, batch_id, document, options, status, attempts, "
                                 "completions, created_at) VALUES (:id, :sid, :bid, 'doc', '{}', 'queued', 0, 0, "
                                 "CURRENT_TIMESTAMP)"), {"id": jid, "sid": sid, "bid": bid})
            conn.execute(sa.text(
                "INSERT INTO schema_arm_stats (schema_id, strategy, draft_len, requests, output_tokens, target_passes, "
                "proposed, accepted, decode_s, latency_s_sum, latency_buckets, d_requests, d_passes, d_decode_s, "
                "seen_at, updated_at) VALUES (:sid, 'ngram', 4, 1, 10, 3, 8, 7, 0.5, 0.6, '[]', 1, 3, 0.5, 1, "
                "CURRENT_TIMESTAMP)"), {"sid": sid})
            conn.execute(sa.text("INSERT INTO schema_position_stats (schema_id, strategy, draft_len, position, proposed, "
                                 "accepted, d_accepted) VALUES (:sid, 'ngram', 4, 0, 3, 2, 2)"), {"sid": sid})
        engine.dispose()
        migrate.upgrade(url, "0005")
        with engine.begin() as conn:
            assert tuple(conn.execute(sa.text(counts)).one()) == (1, 1, 1, 1, 1)
            for table in ("schemas", "batches", "jobs"):
                assert conn.execute(sa.text(f"SELECT tenant FROM {table}")).scalar_one() == "default"
            # the same (name, version) in another tenant is a different schema now
            conn.execute(sa.text(schema.format(tenant="tenant, ", value="'acme', ")), {"id": sid2})
        engine.dispose()
        with pytest.raises(RuntimeError, match="several tenants"):
            migrate.downgrade(url, "0004")
        with engine.begin() as conn:
            conn.execute(sa.text("DELETE FROM schemas WHERE tenant = 'acme'"))
        engine.dispose()
        migrate.downgrade(url, "0004")
        with engine.begin() as conn:
            assert tuple(conn.execute(sa.text(counts)).one()) == (1, 1, 1, 1, 1)
    finally:
        engine.dispose()


def test_reached_migration_fills_history_exactly_and_downgrade_restores_it(empty_database_url):
    """0006 fills `reached` with what the selector derived before it (position 0: the arm's
    passes; position i: accepted at i-1; one extra row where passes reached past the last
    stored position) and batch_size_sum with the request count; downgrade takes it all back."""
    import uuid

    from structspec.db.session import make_session_factory
    from structspec.db.stats import StatsRepository

    url = empty_database_url
    migrate.upgrade(url, "0005")
    engine = make_engine(url)
    sid = "0" * 32 if url.startswith("sqlite") else "00000000-0000-0000-0000-000000000000"
    arm = ("INSERT INTO schema_arm_stats (schema_id, strategy, draft_len, requests, output_tokens, target_passes, "
           "proposed, accepted, decode_s, latency_s_sum, latency_buckets, d_requests, d_passes, d_decode_s, "
           "seen_at, updated_at) VALUES (:sid, :s, :k, :r, 10, :passes, 8, 7, 0.5, 0.6, '[]', 1, :d, 0.5, 1, "
           "CURRENT_TIMESTAMP)")
    pos = ("INSERT INTO schema_position_stats (schema_id, strategy, draft_len, position, proposed, accepted, d_accepted) "
           "VALUES (:sid, :s, :k, :p, :prop, :acc, :dacc)")
    arms = [("ngram", 4, 3, 10, 7.5), ("schema", 2, 2, 6, 6.0), ("composite", 8, 1, 4, 3.25),
            ("none", 0, 5, 9, 9.0), ("schema", 4, 1, 3, 2.5)]
    positions = {("ngram", 4): [(10, 6, 4.5), (8, 3, 2.25), (5, 2, 1.5)],  # cut at 3 of 4: position 3 reached
                 ("schema", 2): [(6, 5, 5.0), (5, 1, 0.75)],  # full k: nothing past it
                 ("composite", 8): [(4, 0, 0.0)],  # nothing accepted: position 1 never reached
                 ("schema", 4): []}  # drafts always empty: position 0 reached every pass
    rows = ("SELECT strategy, draft_len, position, proposed, accepted, d_accepted, {extra} FROM schema_position_stats "
            "ORDER BY strategy, draft_len, position")
    try:
        with engine.begin() as conn:
            conn.execute(sa.text("INSERT INTO schemas (id, name, version, body, hash, created_at, updated_at) "
                                 "VALUES (:sid, 'n', 1, '{}', 'h', CURRENT_TIMESTAMP, CURRENT_TIMESTAMP)"), {"sid": sid})
            for s, k, r, passes, d in arms:
                conn.execute(sa.text(arm), {"sid": sid, "s": s, "k": k, "r": r, "passes": passes, "d": d})
            for (s, k), ps in positions.items():
                for p, (prop, acc, dacc) in enumerate(ps):
                    conn.execute(sa.text(pos), {"sid": sid, "s": s, "k": k, "p": p, "prop": prop, "acc": acc,
                                                "dacc": dacc})
            before = [tuple(r) for r in conn.execute(sa.text(rows.format(extra="1")))]
        engine.dispose()

        migrate.upgrade(url, "0006")
        with engine.begin() as conn:
            got = [tuple(r) for r in conn.execute(sa.text(rows.format(extra="reached, d_reached")))]
            assert got == [("composite", 8, 0, 4, 0, 0.0, 4, 3.25),
                           ("ngram", 4, 0, 10, 6, 4.5, 10, 7.5), ("ngram", 4, 1, 8, 3, 2.25, 6, 4.5),
                           ("ngram", 4, 2, 5, 2, 1.5, 3, 2.25), ("ngram", 4, 3, 0, 0, 0.0, 2, 1.5),
                           ("schema", 2, 0, 6, 5, 5.0, 6, 6.0), ("schema", 2, 1, 5, 1, 0.75, 5, 5.0),
                           ("schema", 4, 0, 0, 0, 0.0, 3, 2.5)]
            sums = conn.execute(sa.text("SELECT strategy, draft_len, batch_size_sum FROM schema_arm_stats "
                                        "ORDER BY strategy, draft_len")).all()
            assert [tuple(r) for r in sums] == [("composite", 8, 1.0), ("ngram", 4, 3.0), ("none", 0, 5.0),
                                                ("schema", 2, 2.0), ("schema", 4, 1.0)]
            # a row written without the new columns (older code) gets their server default
            conn.execute(sa.text(pos), {"sid": sid, "s": "ngram", "k": 4, "p": 4, "prop": 0, "acc": 0, "dacc": 0})
            assert conn.execute(sa.text("SELECT reached, d_reached FROM schema_position_stats "
                                        "WHERE position = 4")).one() == (0, 0.0)
            conn.execute(sa.text("DELETE FROM schema_position_stats WHERE position = 4"))
        engine.dispose()

        # the selector reads the migrated history exactly as it derived it before 0006
        from structspec.stats.selector import position_counts

        factory = make_session_factory(engine)
        with factory() as session:
            views = StatsRepository(session).views(uuid.UUID(sid), half_life=0)
        legacy = [dataclasses.replace(v, reached_by_position=None) for v in views]
        for s in ("ngram", "schema", "composite"):
            assert position_counts(views, s, 8) == position_counts(legacy, s, 8)
        engine.dispose()

        migrate.downgrade(url, "0005")
        with engine.begin() as conn:
            assert [tuple(r) for r in conn.execute(sa.text(rows.format(extra="1")))] == before
            assert conn.execute(sa.text("SELECT count(*) FROM schema_arm_stats")).scalar_one() == 5
        columns = {t: {c["name"] for c in sa.inspect(engine).get_columns(t)}
                   for t in ("schema_arm_stats", "schema_position_stats")}
        assert not {"reached", "d_reached"} & columns["schema_position_stats"]
        assert "batch_size_sum" not in columns["schema_arm_stats"]
    finally:
        engine.dispose()


def test_files_move_into_parts_and_back_with_every_byte(empty_database_url):
    """0016 moves files.content into file_parts (one part each) and the downgrade joins them back."""
    url = empty_database_url
    migrate.upgrade(url, "0015")
    engine = make_engine(url)
    content = bytes(range(256)) * 10
    try:
        with engine.begin() as conn:
            conn.execute(sa.text("INSERT INTO files (id, tenant, purpose, filename, bytes, content, created_at) "
                                 "VALUES ('file-1', 'default', 'user_data', 'a.pdf', :n, :c, CURRENT_TIMESTAMP)"),
                         {"n": len(content), "c": content})
        engine.dispose()
        migrate.upgrade(url, "0016")
        with engine.begin() as conn:
            assert conn.execute(sa.text("SELECT seq, data FROM file_parts WHERE file_id = 'file-1'")).all() == \
                [(0, content)]
            conn.execute(sa.text("INSERT INTO file_parts (file_id, seq, data) VALUES ('file-1', 1, :d)"), {"d": b"+"})
        engine.dispose()
        migrate.downgrade(url, "0015")
        with engine.begin() as conn:
            assert conn.execute(sa.text("SELECT content FROM files")).scalar_one() == content + b"+"
    finally:
        engine.dispose()
