"""Acceptance statistics of a schema, its strategy pin, and the /metrics exposition."""

from __future__ import annotations

from sqlalchemy.orm import Session, sessionmaker

from structspec.api.errors import ErrorItem, NotFoundError, UnprocessableError
from structspec.api.structs import ArmStats, SchemaStats, StrategyChoice, StrategyPin
from structspec.config import Settings
from structspec.db.columns import database_now
from structspec.db.jobs import JobRepository
from structspec.db.models import DEFAULT_TENANT
from structspec.db.repositories import SchemaRepository
from structspec.db.stats import StatsRepository
from structspec.options import AUTO, OptionError, RequestOptions
from structspec.stats import metrics
from structspec.services.schemas import parse_id
from structspec.services.strategy import choose_for_job


class StatsService:
    """Statistics of one tenant's schemas; `metrics` covers all (per strategy; per tenant and
    schema only for the operator's token, api/metrics.py)."""

    def __init__(self, session_factory: sessionmaker[Session], settings: Settings, tenant: str = DEFAULT_TENANT):
        self.session_factory = session_factory
        self.settings = settings
        self.tenant = tenant

    def get(self, schema_id: str) -> SchemaStats:
        sid = parse_id(schema_id)
        with self.session_factory() as session:
            self._live(session, schema_id, sid)
            repo = StatsRepository(session)
            arms = repo.arms(sid)
            pin = repo.pin(sid)
            choice, why = choose_for_job(session, self.settings, sid)
        return SchemaStats(
            schema_id=sid, selected=StrategyChoice(strategy=choice.strategy, draft_len=choice.draft_len),
            selected_by=why, pinned=StrategyChoice(strategy=pin.strategy, draft_len=pin.draft_len) if pin else None,
            strategies=[ArmStats(strategy=a.strategy, draft_len=a.draft_len, requests=a.requests,
                                 output_tokens=a.output_tokens, target_passes=a.target_passes, proposed=a.proposed,
                                 accepted=a.accepted,
                                 acceptance_rate=round(a.accepted / a.proposed, 4) if a.proposed else 0.0,
                                 tokens_per_pass=round(a.output_tokens / a.target_passes, 4) if a.target_passes else 0.0,
                                 tokens_per_second=round(a.output_tokens / a.decode_s, 2) if a.decode_s > 0 else 0.0,
                                 decode_s=round(a.decode_s, 4), accepted_by_position=a.accepted_by_position,
                                 proposed_by_position=a.proposed_by_position,
                                 mean_batch_size=round(a.batch_size_sum / a.requests, 4) if a.requests else None)
                        for a in arms])

    def set_pin(self, schema_id: str, data: StrategyPin) -> SchemaStats:
        """Pin (or with strategy "auto", unpin) the schema's strategy for `auto` jobs."""
        sid = parse_id(schema_id)
        if data.strategy != AUTO:
            try:  # what an auto job of the schema will run: a concrete strategy and k
                pin = RequestOptions(strategy=data.strategy, draft_len=data.draft_len).with_defaults(self.settings)
                pin.check(concrete=True)
            except OptionError as e:
                raise UnprocessableError(f"invalid pin: {e}", [
                    ErrorItem(path=f"/{e.option}", message=str(e), source="body")]) from None
        with self.session_factory.begin() as session:
            self._live(session, schema_id, sid)
            repo = StatsRepository(session)
            if data.strategy == AUTO:
                repo.clear_pin(sid)
            else:
                repo.set_pin(sid, pin.strategy, pin.draft_len)
        return self.get(schema_id)

    def metrics(self, per_schema: bool = False) -> bytes:
        with self.session_factory() as session:
            rows = StatsRepository(session).metric_rows()
            now = database_now(session)
            backlog = {status: (n, (now - oldest).total_seconds() if oldest else 0.0)
                       for status, (n, oldest) in JobRepository(session).backlog().items()}
        return metrics.render(rows, backlog, per_schema)

    def _live(self, session: Session, schema_id: str, sid) -> None:
        if SchemaRepository(session, self.tenant).get(sid) is None:
            raise NotFoundError(f"no schema with id {schema_id}")
