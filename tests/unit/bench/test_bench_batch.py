"""python -m bench.batch: the synthetic receipts and the report arithmetic (no model)."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from bench import batch_report as rep
from bench.receipts import RECEIPT_SCHEMA, receipts
from bench.receipts import main as write_receipts
from bench.strategies import load_dataset

SCHEMA = json.loads(RECEIPT_SCHEMA.read_text())


def test_receipts_are_the_same_for_a_seed_and_differ_between_seeds():
    assert receipts(32, seed=0) == receipts(32, seed=0)
    assert receipts(8, seed=0) == receipts(32, seed=0)[:8]  # a longer run extends a shorter one
    assert [r["text"] for r in receipts(8, seed=1)] != [r["text"] for r in receipts(8, seed=0)]


def test_receipts_vary_in_shop_layout_and_payment():
    rs = receipts(32)
    assert len({r["text"] for r in rs}) == 32
    assert len({r["gold"]["merchant"] for r in rs}) >= 8
    assert {r["gold"]["payment"] for r in rs} == {"cash", "card", "other"}
    assert len({len(r["gold"]["items"]) for r in rs}) >= 3
    assert any("Subtotal" in r["text"] for r in rs) and any("Subtotal" not in r["text"] for r in rs)


def test_receipts_written_as_a_dataset_load_back_with_their_schema(tmp_path, capsys):
    out = tmp_path / "sub" / "receipts.jsonl"
    assert write_receipts(["--n", "5", "--seed", "2", "--out", str(out)]) == 0
    assert f"5 receipts written to {out}" in capsys.readouterr().out
    rows = load_dataset(str(out), 100)
    assert [r["id"] for r in rows] == [r["id"] for r in receipts(5, seed=2)]
    assert all(r["schema"] == SCHEMA and r["gold"] == g["gold"] for r, g in zip(rows, receipts(5, seed=2)))


def test_receipt_gold_validates_and_is_printed_in_the_text():
    for r in receipts(40, seed=3):
        gold, text = r["gold"], r["text"]
        jsonschema.validate(gold, SCHEMA)
        assert gold["merchant"] in text and gold["date"] in text
        for item in gold["items"]:
            assert item["name"] in text
        items = round(sum(i["price"] for i in gold["items"]), 2)
        assert items <= gold["total"] <= round(items * 1.2, 2) + 0.01  # tax at most 20%
        amounts = {float(a) for a in re.findall(r"\d+\.\d\d|\b\d+\b", text)}
        assert gold["total"] in amounts or float(round(gold["total"])) in amounts


def test_ratio_and_formatting_say_n_a_for_a_missing_baseline():
    assert rep.ratio(6.0, 2.0) == 3.0
    assert rep.ratio(1.0, 0.0) is None and rep.ratio(None, 2.0) is None and rep.ratio(1.0, None) is None
    assert rep.fmt_ratio(2.345) == "2.35x" and rep.fmt_ratio(None) == "n/a"
    assert rep.fmt(0.1234, ".1%") == "12.3%"


def test_verdict_against_a_target_either_way():
    assert rep.verdict(3.0, 3.0) == "met" and rep.verdict(2.99, 3.0) == "missed"
    assert rep.verdict(0.12, 0.15, higher_is_better=False) == "met"
    assert rep.verdict(0.2, 0.15, higher_is_better=False) == "missed"
    assert rep.verdict(None, 3.0) == "not measured"


def stats(tokens, passes, prefill_s, decode_s, batch=1.0, prompt=100, computed=100, reused=0):
    return {"output_tokens": tokens, "target_passes": passes, "prefill_s": prefill_s, "decode_s": decode_s,
            "batch_size": batch, "prompt_tokens": prompt, "prefill_tokens": computed, "prefix_tokens": reused}


def test_summary_separates_end_to_end_from_decode_rates():
    m = {"steps": 60, "decode_steps": 50, "rows": 900, "prefill_rows": 800, "step_s": 9.5, "forward_s": 9.0,
         "verify_s": 0.1, "prefill_step_s": 3.0}
    s = rep.summarize_run("auto@16", [stats(100, 20, 1.0, 4.0, batch=2.0), stats(60, 30, 1.0, 1.0, batch=4.0)],
                          ["truncated", "succeeded"], wall_s=10.0, metrics=m,
                          decode_only={"steps": 40, "s": 6.4, "tokens": 128})
    assert s["output_tokens"] == 160 and s["target_passes"] == 50
    assert s["e2e_tok_s"] == pytest.approx(16.0)  # wall clock, prefill included
    assert s["decode_tok_s"] == pytest.approx(128 / 6.4)  # steps that computed no prefill rows
    assert s["share_decode_tok_s"] == pytest.approx(160 / 5.0)  # the requests' row shares
    assert s["prefill_share"] == pytest.approx(0.3)  # steps with prefill rows over the wall
    assert s["mean_batch"] == pytest.approx((2 * 20 + 4 * 30) / 50)  # weighted by passes
    assert s["statuses"] == {"truncated": 1, "succeeded": 1}
    plain = rep.summarize_run("x", [stats(100, 20, 1.0, 4.0)], ["truncated"], wall_s=10.0)
    assert plain["decode_tok_s"] == pytest.approx(25.0) and plain["prefill_share"] == pytest.approx(0.1)


def test_pooled_repeats_recompute_rates_from_totals():
    a = rep.summarize_run("x", [stats(100, 50, 1.0, 4.0)], ["truncated"], wall_s=5.0)
    b = rep.summarize_run("x", [stats(100, 50, 1.0, 1.0)], ["truncated"], wall_s=3.0)
    p = rep.pooled([a, b, rep.summarize_run("y", [stats(1, 1, 0, 1)], ["x"], 1.0)], "x")
    assert p["repeats"] == 2 and p["output_tokens"] == 200
    assert p["e2e_tok_s"] == pytest.approx(200 / 8.0) and p["decode_tok_s"] == pytest.approx(200 / 5.0)
    assert p["prefill_step_s"] is None  # not measured without the engine's metrics
    assert rep.pooled([a], "missing") is None


def test_throughput_table_gives_both_ratios_against_each_baseline():
    one = rep.summarize_run("auto@1", [stats(100, 25, 2.0, 8.0)], ["truncated"], wall_s=10.0)
    many = rep.summarize_run("auto@16", [stats(100, 25, 2.0, 2.0)], ["truncated"], wall_s=4.0)
    text = rep.throughput_table([one, many], {"auto@1": "auto@1"})
    head, _, row1, row2 = text.splitlines()
    assert "e2e vs auto@1" in head and "decode vs auto@1" in head
    assert row1.endswith("| 1.00x | 1.00x |")
    assert row2.endswith("| 2.50x | 4.00x |")  # e2e 25 vs 10 tok/s, decode 50 vs 12.5


def test_overhead_is_exact_only_without_prefill_rows():
    m = {"steps": 10, "decode_steps": 10, "rows": 160, "prefill_rows": 0, "step_s": 10.0, "forward_s": 9.0,
         "verify_s": 0.5, "prefill_step_s": 0.0}
    assert rep.overhead(m)["decode_only"] == pytest.approx(0.1)
    assert rep.overhead({**m, "prefill_rows": 5})["decode_only"] is None
    assert rep.metrics_delta({"steps": 4, "step_s": 1.0}, {"steps": 10, "step_s": 3.5}) == {"steps": 6, "step_s": 2.5}


def test_cost_points_take_the_nearest_measured_bucket_at_or_below():
    pts = rep.cost_points({1: 0.1, 2: 0.15, 16: 0.4, 19: 0.45}, rows=(1, 2, 4, 16, 32))
    assert [p["rows"] for p in pts] == [1, 2, 16, 19]
    assert pts[2]["s_per_row"] == pytest.approx(0.025) and pts[2]["vs_one_row"] == pytest.approx(4.0)


def test_markdown_states_each_target_as_met_or_missed():
    from bench.batch import md_a

    one = {**rep.summarize_run("auto@1", [stats(100, 25, 2.0, 8.0)], ["truncated"], wall_s=10.0), "repeats": 1}
    auto = {**rep.summarize_run("auto@16", [stats(100, 25, 2.0, 2.0)], ["truncated"], wall_s=4.0), "repeats": 1}
    none = {**rep.summarize_run("none@16", [stats(100, 100, 2.0, 2.5)], ["truncated"], wall_s=4.5), "repeats": 1}
    part = {"batch": 16, "pooled": [one, auto, none], "runs": [], "documents": ["d"], "auto_arms": {},
            "warmup_arms": [], "identical_to_auto1": {"auto@16": 1},
            "verdicts": {"e2e_vs_auto1": 2.5, "decode_vs_auto1": 4.0, "e2e_vs_none": 1.125, "decode_vs_none": 1.25,
                         "amdahl_e2e_bound_vs_auto1": 5.0}}
    text = md_a(part)
    assert "end to end **missed** (2.50x), decode **met** (4.00x)" in text
    assert "batched auto >= batched none: end to end **met** (1.12x)" in text
