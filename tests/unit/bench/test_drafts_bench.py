"""bench.drafts: its offline walk of a fixed strategy is the engine's own (the same passes where
the outputs are the same), and bad arguments are refused by name."""

from __future__ import annotations

import pytest

from bench import drafts
from bench.receipts import receipt_rows
from structspec.engine.engine import Request
from structspec.engine.proposers.suffix import History
from structspec.options import RequestOptions


def test_the_walk_of_a_fixed_strategy_takes_the_engines_passes(tiny_compact_engine):
    engine = tiny_compact_engine
    rows = receipt_rows(4)
    none = engine.run([Request(r["schema"], r["text"], RequestOptions(strategy="none", max_tokens=40)) for r in rows])
    outputs = [(list(r.tokens), r.text, r.status == "succeeded") for r in none]
    for strategy, k in (("composite", 4), ("ngram", 8)):
        ran = engine.run([Request(r["schema"], r["text"], RequestOptions(strategy=strategy, draft_len=k, max_tokens=40))
                          for r in rows])
        walked = drafts.walk(engine, rows, outputs, strategy, k, misses=3)
        same = [i for i, r in enumerate(ran) if list(r.tokens) == outputs[i][0]]
        assert same, "every output differs from none's: nothing to compare"
        assert [walked.passes[i] for i in same] == [ran[i].stats.target_passes for i in same]
        assert walked.tokens == sum(len(t) for t, _, _ in outputs)
        assert walked.rows >= sum(walked.passes)  # a row per pass at least: the last token's
        assert len(walked.misses) <= 3
        assert walked.line().startswith(f"{strategy}:{k}: passes most {max(walked.passes)}, sum {sum(walked.passes)}")


def test_the_memory_learns_succeeded_outputs_in_order(tiny_compact_engine):
    engine = tiny_compact_engine
    rows = receipt_rows(3)
    none = engine.run([Request(r["schema"], r["text"], RequestOptions(strategy="none", max_tokens=40)) for r in rows])
    outputs = [(list(r.tokens), r.text, True) for r in none]
    memory = History(100_000)
    drafts.walk(engine, rows, outputs, "suffix", 4, memory)
    assert memory.outputs == 3
    untouched = History(100_000)
    drafts.walk(engine, rows, [(t, x, False) for t, x, _ in outputs], "suffix", 4, untouched)
    assert untouched.outputs == 0  # a truncated or invalid output is not learnt


@pytest.mark.parametrize("spec", ["composite", "fast:8", "ngram:0", "none:4"])
def test_bad_strategies_are_named(spec, capsys):
    with pytest.raises(SystemExit):
        drafts.main(["--strategies", spec])
    assert f"--strategies: {spec!r} is not STRATEGY:K" in capsys.readouterr().err
