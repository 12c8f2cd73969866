"""The loop guard (structspec/engine/loopguard.py): the rule, and the engine applying it the
same way under every strategy."""

from __future__ import annotations

import pytest

from structspec.engine.loopguard import MIN_TOKENS, LoopGuard
from structspec.options import STRATEGIES, RequestOptions


def first_fire(tokens: list[int], repeats: int = 4, chunk: int = 1) -> int | None:
    """Feed `tokens` `chunk` at a time, as steps would; where the rule first holds."""
    guard = LoopGuard(repeats)
    for end in range(chunk, len(tokens) + chunk, chunk):
        fired = guard.feed(tokens[:end])
        if fired is not None:
            return fired
    return None


def test_a_block_repeated_four_times_fires_at_the_end_of_the_fourth():
    block = list(range(100, 116))  # 16 tokens: 4 x 16 = 64 >= MIN_TOKENS
    tokens = [1, 2, 3] + block * 6
    assert first_fire(tokens) == 3 + 4 * 16


@pytest.mark.parametrize("chunk", [2, 5, 9, 64])
def test_steps_of_several_tokens_find_the_same_position(chunk):
    tokens = [7, 8] + list(range(30, 50)) * 5 + [1] * 10
    assert first_fire(tokens, chunk=chunk) == first_fire(tokens) == 2 + 4 * 20


def test_short_runs_and_varying_loops_do_not_fire():
    assert first_fire([5] * (MIN_TOKENS - 1)) is None  # below the minimum run
    assert first_fire([5] * MIN_TOKENS) == MIN_TOKENS
    counting = [t for i in range(40) for t in (100, 101, 200 + i)]  # a counter in every item
    assert first_fire(counting) is None
    assert first_fire(list(range(100, 116)) * 3) is None  # three repeats, not four


# --- the counting rule: inside one string, digits aside -------------------------------------

TEXT = {1: b'{"city":"', 2: b"_", 3: b"Laguna", 4: b'"}', 5: b"[", 6: b",", 7: b"]", 8: b'\\"', 9: b'"'}
TEXT.update({10 + d: str(d).encode() for d in range(10)})  # ids 10-19: the digits


def text_bytes(ids) -> bytes:
    return b"".join(TEXT[i] for i in ids)


def digits(n: int) -> list[int]:
    return [10 + int(c) for c in str(n)]


def first_fire_text(tokens: list[int], chunk: int = 1) -> tuple[int | None, LoopGuard]:
    guard = LoopGuard(4)
    for end in range(chunk, len(tokens) + chunk, chunk):
        fired = guard.feed(tokens[:end], text_bytes)
        if fired is not None:
            return fired, guard
    return None, guard


def test_a_string_that_counts_fires_the_counting_rule():
    """"Laguna_2018_2019_...": blocks of 5 tokens ("_" and four digits) that differ only in their
    digits. The shortest period whose 4 blocks reach MIN_TOKENS is 15 (three years)."""
    tokens = [1, 3] + [t for year in range(2000, 2040) for t in [2, *digits(year)]]
    fired, guard = first_fire_text(tokens)
    assert guard.rule == "counting" and guard.period == 15
    # shapes start after the token that opened the string (index 1 on); position j of them
    # repeats position j - 15 from j = 16 on, and 45 such positions in a row fire the rule
    assert fired == 1 + 16 + 45
    assert first_fire(tokens) is None  # the identical rule alone never fires: every year differs


@pytest.mark.parametrize("chunk", [3, 7, 40])
def test_the_counting_rule_fires_at_the_same_position_whatever_the_step_size(chunk):
    tokens = [1, 3] + [t for year in range(2000, 2040) for t in [2, *digits(year)]]
    assert first_fire_text(tokens, chunk)[0] == first_fire_text(tokens)[0]


def test_the_counting_rule_can_be_turned_off():
    tokens = [1, 3] + [t for year in range(2000, 2040) for t in [2, *digits(year)]]
    assert LoopGuard(4, counting=False).feed(tokens, text_bytes) is None


def test_numbers_outside_strings_never_fire_the_counting_rule():
    """An array of numbers of one shape is ordinary output."""
    tokens = [5] + [t for year in range(2000, 2100) for t in [*digits(year), 6]] + [7]
    assert first_fire_text(tokens)[0] is None


def test_a_closing_quote_starts_the_count_again_and_an_escaped_one_does_not():
    short = [t for year in range(2000, 2011) for t in [2, *digits(year)]]  # 55 tokens: under the run
    assert first_fire_text([1, 3] + short + [4, 1, 3] + short + [4])[0] is None  # two strings
    long = [t for year in range(2000, 2040) for t in [2, *digits(year)]]
    assert first_fire_text([1, 3, 8] + long + [4])[1].rule == "counting"  # \" does not end the string
    assert first_fire_text([1, 3, 9] + long + [4])[0] is None  # " does: the years are outside it


LOOPY = {"type": "array", "items": {"enum": ["alpha", "beta"]}}


def test_the_engine_stops_a_loop_at_the_same_token_under_every_strategy(tiny_normal_loaded):
    """The normal-init tiny model writes "alpha" until max_tokens without the guard. With it,
    every strategy stops at the same token as `none` (or first diverges from it at a near-tie,
    test_batched.Tally), with the cut output a prefix of the unguarded one."""
    from structspec.engine.engine import Engine, Request
    from tests.unit.engine.test_batched import Tally

    guarded = Engine(tiny_normal_loaded, kernel_backend="torch")
    free = Engine(tiny_normal_loaded, kernel_backend="torch", engine_loop_repeats=0)
    text = "tags: alpha beta alpha"
    unguarded = free.extract(LOOPY, text, RequestOptions(strategy="none", max_tokens=300))
    assert unguarded.stats.stop_reason == "max_tokens"
    [ref] = guarded.run([Request(LOOPY, text, RequestOptions(strategy="none", max_tokens=300), trace=True)])
    assert ref.status == "truncated" and ref.stats.stop_reason == "repetition", ref.error
    assert "the output repeats itself" in ref.error and "STRUCTSPEC_ENGINE_LOOP_REPEATS" in ref.error
    assert len(ref.tokens) < 300 and ref.tokens == unguarded.tokens[:len(ref.tokens)]
    assert ref.text == guarded.token_text.text_of(ref.tokens)
    tally = Tally()
    for strategy in STRATEGIES:
        for k in (1, 4, 9):
            res = guarded.extract(LOOPY, text, RequestOptions(strategy=strategy, draft_len=k, max_tokens=300))
            if tally.check(ref, res, f"{strategy} k={k}"):
                assert res.stats.stop_reason == "repetition"
    assert tally.identical > 0, tally
