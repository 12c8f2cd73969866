"""bench.onoff's arguments: only the engine settings that cannot change an output, counts of at
least one, refused before any model loads."""

from __future__ import annotations

import pytest

from bench import onoff


def test_only_settings_that_keep_every_output_are_offered(capsys):
    with pytest.raises(SystemExit):
        onoff.main(["--setting", "engine_lean_forward"])  # changes fp32 logits in their last bits
    assert "invalid choice: 'engine_lean_forward'" in capsys.readouterr().err
    assert onoff.SAME_OUTPUT == ("engine_confidence", "engine_pruned_logits")


@pytest.mark.parametrize("args", [["--docs", "0"], ["--rounds", "0"], ["--max-tokens", "0"]])
def test_counts_below_one_are_refused(args):
    with pytest.raises(SystemExit, match="must be at least 1"):
        onoff.main(args)
