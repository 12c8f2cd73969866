"""One request's stats travel as a dict: the engine's RequestStats.as_dict() is stored with the
job, read back into the API's JobStats and JobTimings, logged by the worker (LOGGED_STATS) and
folded into the schema's statistics (stats/aggregate.py). Every name read downstream must be
one the engine writes, so a rename fails here instead of showing as null or as a KeyError."""

from __future__ import annotations

import ast
import inspect

from structspec.api.structs import JobStats, JobTimings
from structspec.engine.sequence import RequestStats
from structspec.services.chunks import ChunkStats
from structspec.stats import aggregate
from structspec.worker.tasks import LOGGED_STATS

WRITTEN = set(RequestStats("none", 0).as_dict())
CHUNKED = set(ChunkStats("none", 0).as_dict())  # a document extracted in chunks adds its counts


def test_the_api_reads_only_what_the_engine_writes():
    assert set(JobStats.__struct_fields__) <= CHUNKED and WRITTEN < CHUNKED
    assert set(JobTimings.__struct_fields__) <= WRITTEN


def test_the_worker_logs_only_what_the_engine_writes():
    assert set(LOGGED_STATS) <= WRITTEN


def test_the_aggregates_read_only_what_the_engine_writes():
    """Every stats["k"] and stats.get("k") in stats/aggregate.py."""
    read = set()
    for node in ast.walk(ast.parse(inspect.getsource(aggregate))):
        if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name) and node.value.id == "stats" \
                and isinstance(node.slice, ast.Constant):
            read.add(node.slice.value)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get" \
                and isinstance(node.func.value, ast.Name) and node.func.value.id == "stats" and node.args \
                and isinstance(node.args[0], ast.Constant):
            read.add(node.args[0].value)
    assert {"strategy", "target_passes", "accepted_by_position"} <= read  # the walk finds them
    assert read <= WRITTEN
