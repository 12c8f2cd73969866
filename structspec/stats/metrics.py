"""Prometheus exposition rendered from the database aggregates at scrape time.

Workers and the API are separate processes (and possibly machines); the database rows the
workers update in their result transactions are the one exact, shared count, so /metrics
reads them instead of keeping in-process counters.

Tenants' schemas stay private: by default the counters are summed per strategy over every
schema (label `strategy` only), so nothing names or identifies a tenant's schema. With
`per_schema` (an operator's scrape with STRUCTSPEC_METRICS_TOKEN) they are broken down by
`tenant`, `schema_id`, `schema` (name) and `version` too.
"""

from __future__ import annotations

from typing import Iterable, Sequence

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from structspec.stats.aggregate import LATENCY_BUCKETS

CONTENT_TYPE = "text/plain; version=0.0.4"  # Litestar appends "; charset=utf-8"

COUNTERS = (  # (metric name without _total, row field, help)
    ("structspec_requests", "requests", "Jobs whose engine stats were recorded"),
    ("structspec_output_tokens", "output_tokens", "Tokens generated"),
    ("structspec_target_passes", "target_passes", "Target-model forward passes after prefill"),
    ("structspec_draft_tokens_proposed", "proposed", "Draft tokens sent to verification"),
    ("structspec_draft_tokens_accepted", "accepted", "Draft tokens accepted by the target model"),
    ("structspec_job_batch_size", "batch_size_sum",
     "Sum over jobs of the mean number of sequences decoded together in the job's steps "
     "(over structspec_requests_total: the mean batch size)"),
)


class _Snapshot:
    """A prometheus_client collector over rows read once per scrape."""

    def __init__(self, rows: Sequence, backlog: dict[str, tuple[int, float]], per_schema: bool):
        self.rows, self.backlog, self.per_schema = rows, backlog, per_schema

    def collect(self) -> Iterable:
        jobs = GaugeMetricFamily("structspec_jobs", "Jobs queued or running now (every tenant)", labels=["status"])
        age = GaugeMetricFamily("structspec_oldest_job_age_seconds",
                                "Seconds since the oldest queued or running job was submitted (0: none)",
                                labels=["status"])
        for status, (n, age_s) in self.backlog.items():
            jobs.add_metric([status], n)
            age.add_metric([status], age_s)
        yield jobs
        yield age
        labels = ["tenant", "schema_id", "schema", "version", "strategy"] if self.per_schema else ["strategy"]
        groups: dict[tuple, dict] = {}
        for r in self.rows:  # sum over draft lengths (and, unless per_schema, over schemas)
            key = ((r.tenant, str(r.schema_id), r.name, str(r.version), r.strategy) if self.per_schema
                   else (r.strategy,))
            g = groups.setdefault(key, {"decode_s": 0.0, "latency_s_sum": 0.0,
                                        "buckets": [0] * (len(LATENCY_BUCKETS) + 1),
                                        **{f: 0 for _, f, _ in COUNTERS}})
            for _, f, _ in COUNTERS:
                g[f] += getattr(r, f)
            g["decode_s"] += r.decode_s
            g["latency_s_sum"] += r.latency_s_sum
            for i, n in enumerate(r.latency_buckets or []):
                g["buckets"][i] += n
        for name, f, doc in COUNTERS:
            m = CounterMetricFamily(name, doc, labels=labels)
            for key, g in groups.items():
                m.add_metric(list(key), g[f])
            yield m
        m = CounterMetricFamily("structspec_decode_seconds", "Seconds spent decoding (after prefill)", labels=labels)
        for key, g in groups.items():
            m.add_metric(list(key), g["decode_s"])
        yield m
        h = HistogramMetricFamily("structspec_job_latency_seconds",
                                  "Job latency, submitted to result stored", labels=labels)
        for key, g in groups.items():
            cum, buckets = 0, []
            for bound, n in zip([*map(_fmt, LATENCY_BUCKETS), "+Inf"], g["buckets"]):
                cum += n
                buckets.append((bound, cum))
            h.add_metric(list(key), buckets, g["latency_s_sum"])
        yield h


def _fmt(x: float) -> str:
    return repr(float(x))


def render(rows: Sequence, backlog: dict[str, tuple[int, float]], per_schema: bool = False) -> bytes:
    """Prometheus text format for StatsRepository.metric_rows() and the job backlog
    ({status: (jobs, age of the oldest in seconds)}); per strategy, or with `per_schema` per
    (tenant, schema, strategy)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Snapshot(rows, backlog, per_schema))
    return generate_latest(registry)
