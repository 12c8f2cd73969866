"""Acceptance statistics and strategy pins: the SQL behind structspec/stats.

`record` folds one job's engine stats into its (schema, strategy, draft_len) row and that
row's per-position rows, inside the caller's transaction (the worker's result transaction,
so a stored result and its stats commit together or not at all). The row is created if
absent (INSERT .. ON CONFLICT DO NOTHING) and then locked (SELECT .. FOR UPDATE on
PostgreSQL; SQLite has one writer, whose lock the job UPDATE already took), so concurrent
workers add exactly. Tables stay at one row per key however many jobs run.
"""

from __future__ import annotations

import uuid
from typing import Any, Sequence

import sqlalchemy as sa
from sqlalchemy.orm import Session

from structspec.db.columns import utcnow
from structspec.db.models import ArmStatsRecord, PositionStatsRecord, SchemaRecord, StrategyPinRecord
from structspec.stats.aggregate import LATENCY_BUCKETS, ArmAggregate, ArmView, arm_strategy

A, P = ArmStatsRecord, PositionStatsRecord


class StatsRepository:
    def __init__(self, session: Session):
        self.session = session

    # --- write (worker) ------------------------------------------------------------------------

    def record(self, schema_id: uuid.UUID, stats: dict[str, Any], *, half_life: float,
               latency_s: float | None = None) -> None:
        strategy, draft_len = arm_strategy(stats), int(stats["draft_len"])
        self._insert_absent(schema_id, strategy, draft_len)
        row = self.session.scalars(
            sa.select(ArmStatsRecord).where(A.schema_id == schema_id, A.strategy == strategy, A.draft_len == draft_len)
            .with_for_update().execution_options(populate_existing=True)).one()
        positions = {p.position: p for p in self._positions(schema_id, strategy, draft_len)}
        clock = self.clock(schema_id)
        agg = to_aggregate(row, positions.values())
        agg.add(stats, clock, half_life, latency_s)
        for name in ("requests", "output_tokens", "target_passes", "proposed", "accepted", "decode_s",
                     "latency_s_sum", "batch_size_sum", "d_requests", "d_passes", "d_decode_s", "seen_at"):
            setattr(row, name, getattr(agg, name))
        row.latency_buckets = list(agg.latency_buckets)
        row.updated_at = utcnow()
        for i in range(len(agg.proposed_by_position)):
            p = positions.get(i)
            if p is None:
                p = PositionStatsRecord(schema_id=schema_id, strategy=strategy, draft_len=draft_len, position=i)
                self.session.add(p)
            p.proposed = agg.proposed_by_position[i]
            p.accepted = agg.accepted_by_position[i]
            p.d_accepted = agg.d_accepted_by_position[i]
            p.reached = agg.reached_by_position[i]
            p.d_reached = agg.d_reached_by_position[i]
        self.session.flush()

    def _insert_absent(self, schema_id: uuid.UUID, strategy: str, draft_len: int) -> None:
        dialect = self.session.get_bind().dialect.name
        if dialect == "postgresql":
            from sqlalchemy.dialects.postgresql import insert
        elif dialect == "sqlite":
            from sqlalchemy.dialects.sqlite import insert
        else:  # pragma: no cover - the project supports these two
            raise NotImplementedError(dialect)
        empty = ArmAggregate(strategy, draft_len)
        self.session.execute(insert(ArmStatsRecord).values(
            schema_id=schema_id, strategy=strategy, draft_len=draft_len, requests=0, output_tokens=0,
            target_passes=0, proposed=0, accepted=0, decode_s=0.0, latency_s_sum=0.0,
            latency_buckets=empty.latency_buckets, batch_size_sum=0.0, d_requests=0.0, d_passes=0.0, d_decode_s=0.0, seen_at=0,
            updated_at=utcnow()).on_conflict_do_nothing())

    # --- read ----------------------------------------------------------------------------------

    def clock(self, schema_id: uuid.UUID) -> int:
        """The schema's request clock: jobs recorded for it so far, over every arm."""
        return int(self.session.scalar(sa.select(sa.func.coalesce(sa.func.sum(A.requests), 0))
                                       .where(A.schema_id == schema_id)) or 0)

    def arms(self, schema_id: uuid.UUID) -> list[ArmAggregate]:
        """Every arm of the schema, ordered by (strategy, draft_len)."""
        rows = self.session.scalars(sa.select(ArmStatsRecord).where(A.schema_id == schema_id)
                                    .order_by(A.strategy, A.draft_len)).all()
        positions: dict[tuple[str, int], list[PositionStatsRecord]] = {}
        for p in self.session.scalars(sa.select(PositionStatsRecord).where(P.schema_id == schema_id)):
            positions.setdefault((p.strategy, p.draft_len), []).append(p)
        return [to_aggregate(r, positions.get((r.strategy, r.draft_len), [])) for r in rows]

    def views(self, schema_id: uuid.UUID, half_life: float) -> list[ArmView]:
        """The selector's input: every arm's decayed counts as of now."""
        arms = self.arms(schema_id)
        clock = sum(a.requests for a in arms)
        return [a.decayed(clock, half_life) for a in arms]

    def metric_rows(self) -> Sequence[sa.Row]:
        """(schema_id, tenant, name, version, strategy, requests, output_tokens, target_passes, proposed,
        accepted, decode_s, batch_size_sum, latency_s_sum, latency_buckets) per arm, for /metrics."""
        q = (sa.select(A.schema_id, SchemaRecord.tenant, SchemaRecord.name, SchemaRecord.version, A.strategy,
                       A.requests,
                       A.output_tokens, A.target_passes, A.proposed, A.accepted, A.decode_s, A.batch_size_sum,
                       A.latency_s_sum, A.latency_buckets)
             .join(SchemaRecord, SchemaRecord.id == A.schema_id)
             .order_by(SchemaRecord.name, SchemaRecord.version, A.strategy, A.draft_len))
        return self.session.execute(q).all()

    def _positions(self, schema_id: uuid.UUID, strategy: str, draft_len: int) -> Sequence[PositionStatsRecord]:
        return self.session.scalars(sa.select(PositionStatsRecord).where(
            P.schema_id == schema_id, P.strategy == strategy, P.draft_len == draft_len)
            .execution_options(populate_existing=True)).all()

    # --- pins ----------------------------------------------------------------------------------

    def pin(self, schema_id: uuid.UUID) -> StrategyPinRecord | None:
        return self.session.get(StrategyPinRecord, schema_id)

    def set_pin(self, schema_id: uuid.UUID, strategy: str, draft_len: int) -> StrategyPinRecord:
        record = self.pin(schema_id)
        if record is None:
            record = StrategyPinRecord(schema_id=schema_id)
            self.session.add(record)
        record.strategy, record.draft_len, record.updated_at = strategy, draft_len, utcnow()
        self.session.flush()
        return record

    def clear_pin(self, schema_id: uuid.UUID) -> None:
        self.session.execute(sa.delete(StrategyPinRecord).where(StrategyPinRecord.schema_id == schema_id))


def to_aggregate(row: ArmStatsRecord, positions) -> ArmAggregate:
    ps = sorted(positions, key=lambda p: p.position)
    n = (ps[-1].position + 1) if ps else 0
    prop, acc, reached, dacc, dreached = [0] * n, [0] * n, [0] * n, [0.0] * n, [0.0] * n
    for p in ps:
        prop[p.position], acc[p.position], reached[p.position] = p.proposed, p.accepted, p.reached
        dacc[p.position], dreached[p.position] = p.d_accepted, p.d_reached
    buckets = list(row.latency_buckets or [])
    buckets += [0] * (len(LATENCY_BUCKETS) + 1 - len(buckets))
    return ArmAggregate(strategy=row.strategy, draft_len=row.draft_len, requests=row.requests,
                        output_tokens=row.output_tokens, target_passes=row.target_passes, proposed=row.proposed,
                        accepted=row.accepted, decode_s=row.decode_s, latency_s_sum=row.latency_s_sum,
                        latency_buckets=buckets, proposed_by_position=prop, accepted_by_position=acc,
                        reached_by_position=reached, batch_size_sum=row.batch_size_sum,
                        d_requests=row.d_requests, d_passes=row.d_passes, d_decode_s=row.d_decode_s,
                        d_accepted_by_position=dacc, d_reached_by_position=dreached, seen_at=row.seen_at)
