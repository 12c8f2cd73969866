"""Acceptance statistics per (schema, strategy, draft_len) and the `auto` strategy selector.

aggregate.py  exact and decayed per-arm counts (pure; shared by the DB and simulations)
selector.py   Thompson sampling over per-position acceptance with a learned pass-cost model
resolve.py    `auto` -> a concrete (strategy, draft_len) for one job (pin, else selector)
metrics.py    Prometheus text rendered from the database aggregates at scrape time
"""
