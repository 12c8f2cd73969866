"""The benchmark harnesses run end to end on two tiny documents (so they cannot rot), and
field accuracy grades leaves the way docs/benchmarks.md says."""

from __future__ import annotations

import argparse
import json

import pytest

from bench.auto import run_auto_bench
from bench.strategies import field_accuracy, run_strategy_bench
from tests.conftest import deepjsoneval_rows


def test_field_accuracy_matches_leaves_by_path_with_whitespace_collapsed():
    gold = {"name": "Ada  Lovelace", "born": 1815, "tags": ["x", "y"], "ok": True}
    assert field_accuracy({"name": "Ada Lovelace", "born": 1815.0, "tags": ["x", "z"], "ok": True}, gold) == (4, 5)
    assert field_accuracy(None, gold) == (0, 5)
    assert field_accuracy({"ok": 1}, {"ok": True}) == (0, 1)  # a boolean is not a number


def write_dataset(tmp_path, n=2):
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in deepjsoneval_rows(n)))
    return str(path)


def test_strategy_bench_runs_every_strategy_in_both_modes(tiny_engine, tmp_path, capsys):
    args = argparse.Namespace(dataset=write_dataset(tmp_path), limit=2, max_chars=0, strategies="ngram,composite",
                              modes="free,verbatim", draft_len=4, max_tokens=24, out=str(tmp_path / "out"))
    assert run_strategy_bench(args, tiny_engine) == 0  # 0: every output identical to none of its mode
    out = capsys.readouterr().out
    for system in ("none", "ngram", "composite", "none+verbatim", "ngram+verbatim", "composite+verbatim"):
        assert f"| {system} | 2 |" in out
    data = json.loads((tmp_path / "out" / "strategies.json").read_text())
    assert len(data["records"]) == 12 and all(r["gold_fields"] > 0 for r in data["records"])


def test_auto_bench_compares_auto_with_every_fixed_arm(tiny_engine, tmp_path, capsys):
    args = argparse.Namespace(dataset=write_dataset(tmp_path, 3), warmup=1, limit=2, max_chars=0,
                              strategies="schema,ngram", draft_lens="2,4", max_tokens=16, half_life=500, seed=0,
                              verbatim=False, out=str(tmp_path / "out"))
    assert run_auto_bench(args, tiny_engine) == 0
    data = json.loads((tmp_path / "out" / "auto.json").read_text())
    arms = {s["arm"] for s in data["summaries"]}
    assert arms == {"none", "schema:2", "schema:4", "ngram:2", "ngram:4", "auto"}
    assert all(s["documents"] == 2 for s in data["summaries"])
    assert sum(data["verdict"]["auto_choices"].values()) == 2
    assert set(data["verdict"]["auto_choices"]) <= arms
    assert "auto = " in capsys.readouterr().out


@pytest.mark.long  # every system of the harness on a real engine; the batch-mode test below keeps the harness in `make test`
def test_comparison_harness_runs_every_system_on_two_tiny_documents(tiny_engine, tmp_path, capsys):
    from bench.harness import run_harness

    schema = {"type": "object", "properties": {"who": {"type": "string"}, "paid": {"enum": ["cash", "card"]}},
              "required": ["who", "paid"]}
    rows = [{"id": i, "schema": schema, "text": text, "gold": {"who": who, "paid": paid}}
            for i, (text, who, paid) in enumerate([("Sold by Ada, paid by card", "Ada", "card"),
                                                   ("Bob took cash", "Bob", "cash"),
                                                   ("Eve paid by card", "Eve", "card")])]
    path = tmp_path / "tiny.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    systems = ("structspec:none,structspec:schema,structspec:ngram,structspec:composite,structspec:auto,"
               "structspec:composite+verbatim,structspec:auto+verbatim,outlines,hf-prompt-lookup")
    args = argparse.Namespace(dataset=str(path), systems=systems, limit=2, warmup=1, max_tokens=24, max_chars=0,
                              seed=0, out=str(tmp_path / "out"))
    assert run_harness(args, tiny_engine) == 0
    out = capsys.readouterr().out
    data = json.loads((tmp_path / "out" / "bench.json").read_text())
    names = systems.split(",")
    assert [s["system"] for s in data["summaries"]] == names
    assert all(s["documents"] == 2 for s in data["summaries"])
    assert len(data["records"]) == 2 * len(names)
    by = {s["system"]: s for s in data["summaries"]}
    for name in names:
        assert f"| {name} | 2 |" in out
        assert by[name]["vs_outlines"] is not None and by[name]["vs_structspec_none"] is not None
    # structspec's successes are schema-valid by construction; the verbatim ones copy the document
    for r in data["records"]:
        if r["system"].startswith("structspec:") and r["stats"]["stop_reason"] in ("grammar", "eos"):
            assert r["schema_valid"]
        if r["system"].endswith("+verbatim") and r["schema_valid"]:
            assert json.loads(r["text"])["who"] in rows[r["id"]]["text"]
    for png in ("speedup.png", "tokens_per_pass.png", "acceptance_by_position.png"):
        assert (tmp_path / "out" / png).stat().st_size > 1000


def test_comparison_harness_batch_mode_hands_each_system_groups_of_documents(tiny_engine, tmp_path, capsys,
                                                                            monkeypatch):
    from bench.harness import run_harness

    monkeypatch.setattr(tiny_engine.scheduler, "max_seqs", 2)  # a group of 3 queues its third document

    who = {"type": "object", "properties": {"who": {"type": "string"}}, "required": ["who"]}
    paid = {"type": "object", "properties": {"paid": {"enum": ["cash", "card"]}}, "required": ["paid"]}
    texts = ["Ada paid by card", "Bob took cash", "Eve paid by card", "Max took cash", "Sam paid by card"]
    rows = [{"id": i, "schema": (who, paid)[i % 2], "text": t} for i, t in enumerate(texts)]
    path = tmp_path / "mixed.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    systems = "structspec:none,structspec:auto,outlines,hf-prompt-lookup"
    args = argparse.Namespace(dataset=str(path), systems=systems, limit=4, warmup=1, max_tokens=12, max_chars=0,
                              seed=0, batch=3, out=str(tmp_path / "out"))
    assert run_harness(args, tiny_engine) == 0
    captured = capsys.readouterr()
    out = captured.out
    assert "batch=3 engine_max_seqs=2" in out and "latency s median" in out
    assert "--batch 3 is more than engine_max_seqs 2" in captured.err
    data = json.loads((tmp_path / "out" / "bench.json").read_text())
    assert data["batch"] == 3
    for name in systems.split(","):
        mine = [r for r in data["records"] if r["system"] == name]
        assert [r["id"] for r in mine] == [1, 2, 3, 4]  # groups [1, 2, 3] and [4]
        first, second = mine[:3], mine[3:]
        # every document of a group is charged the same share of the group's wall clock, and no
        # result arrives after the group ends
        assert len({r["cost_s"] for r in first}) == 1 and first[0]["cost_s"] > 0
        assert all(r["e2e_s"] <= 3 * first[0]["cost_s"] + 1e-3 for r in first)
        assert second[0]["e2e_s"] == pytest.approx(second[0]["cost_s"], abs=0.01)  # alone: latency is its cost
        summary = next(s for s in data["summaries"] if s["system"] == name)
        assert summary["documents"] == 4 and summary["documents_per_min"] > 0
    lookup = [r["e2e_s"] for r in data["records"] if r["system"] == "hf-prompt-lookup"][:3]
    assert lookup == sorted(lookup) and lookup[0] < lookup[2]  # one after another: latencies grow
    # auto sent its choices' acceptance curves and still decoded every document
    assert all(r["output_tokens"] > 0 for r in data["records"] if r["system"] == "structspec:auto")


def test_comparison_harness_refuses_a_batch_below_one(tiny_engine, tmp_path, capsys):
    from bench.harness import run_harness

    args = argparse.Namespace(dataset=write_dataset(tmp_path), systems="structspec:none", limit=1, warmup=0,
                              max_tokens=8, max_chars=0, seed=0, batch=0, out=None)
    assert run_harness(args, tiny_engine) == 2
    assert "--batch must be at least 1, got 0" in capsys.readouterr().err


def test_auto_picker_run_live_learns_between_documents_from_the_same_start_each_call(tiny_engine):
    """bench.peer's one-at-a-time `auto` draws each document from the statistics the ones before
    it left, as the worker draws lone jobs: a new schema probes schema, ngram, suffix, then composite
    (drawn all at once, from no statistics, every plan would be the first probe). Each call
    starts again from the picker's own statistics, which it leaves as they were."""
    from bench.batch import AutoPicker
    from structspec.config import Settings

    schema = {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]}
    rows = [{"schema": schema, "text": f"a is value {i}"} for i in range(4)]
    picker = AutoPicker(Settings(), seed=0)
    assert {p.arm for p in picker.plans(4, 12)} == {"schema:8"}
    first = picker.run_live(tiny_engine, rows, 12)
    arms = [(r.stats.strategy, r.stats.draft_len) for r in first]
    assert arms == [("schema", 8), ("ngram", 8), ("suffix", 8), ("composite", 8)], arms
    assert picker.stats.clock == 0 and picker.stats.arms == {}
    again = picker.run_live(tiny_engine, rows, 12)
    assert [(r.stats.strategy, r.stats.draft_len) for r in again] == arms
    assert [r.text for r in again] == [r.text for r in first]
