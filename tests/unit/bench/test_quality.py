"""bench.quality: grading values by confidence bucket, the model table (no model)."""

from __future__ import annotations

from types import SimpleNamespace

from bench.quality import EDGES, bucket_of, grade, model_table, plot, table


def result(value, confidence, status="succeeded"):
    return SimpleNamespace(status=status, value=value, confidence=confidence)


def test_bucket_edges_belong_to_the_bucket_below():
    assert [bucket_of(c) for c in (0.0, 0.5, 0.51, 0.8, 0.95, 0.96, 0.99, 0.995, 1.0)] == [0, 0, 1, 1, 2, 3, 3, 4, 4]
    assert len(EDGES) == 5 and EDGES[-1] == 1.0


def test_grade_compares_each_leaf_with_the_gold_at_its_pointer():
    rows = [{"gold": {"name": "Ann  Lee", "total": 3, "items": [{"n": "a"}]}},
            {"gold": {"name": "Bo", "total": 1, "items": []}},
            {"gold": {"name": "Cy", "total": 2, "items": []}}]
    results = [
        # name right (white space collapsed), total right (3.0 == 3), an item the gold lacks: wrong
        result({"name": "Ann Lee", "total": 3.0, "items": [{"n": "a"}, {"n": "b"}]},
               {"/name": {"min": 0.3, "mean": 0.9}, "/total": {"min": 0.97, "mean": 0.99},
                "/items/0/n": {"min": 0.9, "mean": 0.9}, "/items/1/n": {"min": 0.9, "mean": 0.95}}),
        result({"name": "Bob", "total": True, "items": []},  # wrong name; true is not the number 1
               {"/name": {"min": 0.6, "mean": 0.7}, "/total": {"min": 0.999, "mean": 0.999}}),
        result(None, None, status="truncated"),  # counted, not graded
    ]
    g = grade(results, rows)
    assert (g["documents"], g["valid"]) == (3, 2)
    counts = [(b["values"], b["correct"]) for b in g["buckets"]]
    assert counts == [(1, 1), (1, 0), (2, 1), (1, 1), (1, 0)]
    assert abs(g["buckets"][2]["confidence_sum"] - 1.8) < 1e-9
    text = table("t", g)
    assert "| (0.8, 0.95] | 2 | 0.900 | 50.0% (1/2) |" in text and "2/3 schema-valid" in text


def test_plot_writes_a_png(tmp_path):
    g = grade([result({"a": "x"}, {"/a": {"min": 0.7, "mean": 0.8}})], [{"gold": {"a": "x"}}])
    plot({"set": g, "empty": grade([], [])}, tmp_path / "c.png")
    assert (tmp_path / "c.png").read_bytes()[:4] == b"\x89PNG"


def test_model_table_reports_validity_and_accuracy_per_set():
    g = {**grade([result({"a": "x"}, {"/a": {"min": 0.7, "mean": 0.8}})], [{"gold": {"a": "x"}}]),
         "gold_matched": 3, "gold_fields": 4, "output_tokens": 17}
    text = model_table([{"model": "m", "sets": {"e-mails": g}}])
    assert text.splitlines()[-1] == "| m | e-mails (1) | 1/1 | 75.0% | 17 |"


def test_results_accuracy_counts_no_leaf_of_a_failed_result_and_skips_rows_without_gold():
    from bench.strategies import results_accuracy

    rows = [{"gold": {"a": "x", "b": 1}}, {"gold": {"a": "y"}}, {"text": "no gold"}]
    results = [result({"a": "x", "b": 2}, {}), result(None, None, status="truncated"), result({"a": "z"}, {})]
    assert results_accuracy(results, rows) == (1, 3)
