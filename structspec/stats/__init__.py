"""Acceptance statistics per (schema, strategy, draft_len) and the `auto` strategy selector:
pure computation, no database (db/stats.py stores the aggregates; services/strategy.py reads
them to choose a job's strategy).

aggregate.py  exact and decayed per-arm counts (shared by db/stats.py and simulations)
selector.py   Thompson sampling over per-position acceptance with a learned pass-cost model
metrics.py    Prometheus text rendered from the database aggregates at scrape time
"""
