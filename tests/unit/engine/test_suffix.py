"""The suffix proposer's memory of earlier outputs (engine/proposers/suffix.py) and its use by
the engine: what it drafts, what it learns, its budgets, and that its drafts change speed only."""

from __future__ import annotations

import pytest

from structspec.engine.proposers.base import NUMBER_HOLE, STRING_HOLE, JsonScan, layout
from structspec.engine.proposers.suffix import MAX_MATCH, History, SuffixIndex, SuffixStore
from structspec.options import RequestOptions
from tests.unit.engine.test_exactness import RECEIPT, RECEIPT_TEXT

A, B, C, D, E = range(100, 105)


# `make test` checks drafts of 1 and 3 tokens; 8 and 16 in `make test-long` (tests/conftest.py)
LONG_PARAMS = {"test_drafts_from_an_earlier_output_are_accepted_and_change_nothing": [{"draft_len": 8}, {"draft_len": 16}]}


def chars(*ids: int) -> str:
    return "".join(chr(i + 1) for i in ids)


def follow(index: SuffixIndex, tail: list[int], budget: int = 8, start: bool = True) -> list[int] | None:
    found = index.follow(chars(*tail), budget, start)
    return None if found is None else [ord(c) - 1 for c in found.items]


# --- the index ----------------------------------------------------------------------------


def test_the_longest_earlier_match_of_the_tail_decides_the_continuation():
    index = SuffixIndex(1000)
    index.add(chars(A, B, C, D))
    index.add(chars(E, B, E, E))
    # after B: two occurrences disagree (C, E); after A B only the first one matches
    assert follow(index, [A, B]) == [C, D]
    assert follow(index, [E, B]) == [E, E]
    assert follow(index, [E, B], budget=1) == [E]


def test_an_empty_output_is_continued_as_earlier_outputs_began():
    index = SuffixIndex(1000)
    for _ in range(3):
        index.add(chars(A, B, C))
    index.add(chars(D, B, C))
    assert follow(index, []) == [A, B, C]  # three of four began with A
    assert follow(index, [], start=False) is None  # no start mark: an empty tail matches nothing


def test_the_most_frequent_continuation_wins_and_the_draft_stops_where_few_agree():
    index = SuffixIndex(1000)
    for last in (C, C, C, D, E, A, B, D, E, A):  # after A B: C three times of ten, the rest spread
        index.add(chars(A, B, last))
    found = index.follow(chars(A, B), 8, start=False)
    assert found.items == chars(C) and found.votes == 10 and found.agreeing == 3
    assert found.last == 3 and found.share == 4 / 12  # (3 + 1) / (10 + 2)
    index = SuffixIndex(1000)
    for last in (C, D, E, A):
        index.add(chars(A, B, last))
    assert follow(index, [A, B], start=False) is None  # a quarter each: under MIN_SHARE, no draft


def vote_item_by_item(index: SuffixIndex, tail: str, budget: int, start: bool):
    """follow()'s continuation as first written: one vote per item (the reference; follow takes
    the stretches every voter left agrees on at once)."""
    from collections import Counter

    from structspec.engine.proposers.base import longest_suffix_match
    from structspec.engine.proposers.suffix import MAX_VOTES, MIN_SHARE, SEP

    key = (SEP if start and len(tail) < MAX_MATCH else "") + tail[-MAX_MATCH:]
    matched, _ = longest_suffix_match(index.text, key, 1, MAX_MATCH)
    if not matched:
        return None
    needle, ends = key[-matched:], []
    i = index.text.rfind(needle)
    while i >= 0 and len(ends) < MAX_VOTES:
        if i + matched < len(index.text):
            ends.append(i + matched)
        i = index.text.rfind(needle, 0, i + matched - 1)
    voters, out, first, last = len(ends), [], 0, 0
    while len(out) < budget and ends:
        counts = Counter(index.text[e] for e in ends)
        counts.pop(SEP, None)
        if not counts:
            break
        ch, n = counts.most_common(1)[0]
        if n < MIN_SHARE * voters:
            break
        first, last = first or n, n
        out.append(ch)
        ends = [e + 1 for e in ends if index.text[e] == ch]
    return ("".join(out), matched, voters, first, last) if out else None


def test_taking_agreed_stretches_at_once_drafts_what_voting_item_by_item_does():
    import random

    rng = random.Random(7)
    compared = drafted = 0
    for trial in range(300):
        index = SuffixIndex(100_000)
        alphabet = [A, B, C, D, E][:rng.randint(2, 5)]
        template = [rng.choice(alphabet) for _ in range(rng.randint(3, 30))]
        for _ in range(rng.randint(1, 40)):  # outputs that mostly follow one template, with edits
            out = [t if rng.random() > 0.15 else rng.choice(alphabet) for t in template]
            index.add(chars(*out[:rng.randint(1, len(out))]))
        for _ in range(5):
            tail = chars(*[rng.choice(alphabet) for _ in range(rng.randint(0, 12))])
            budget, start = rng.randint(1, 24), rng.random() < 0.5
            found = index.follow(tail, budget, start)
            got = None if found is None else (found.items, found.matched, found.votes, found.agreeing, found.last)
            assert got == vote_item_by_item(index, tail, budget, start), (trial, tail, budget, start)
            compared += 1
            drafted += got is not None and len(got[0]) > 1
    assert compared == 1500 and drafted > 300  # the cases were not all empty


def test_only_the_most_recent_occurrences_vote():
    index = SuffixIndex(10_000)
    for _ in range(40):
        index.add(chars(A, B, C))
    for _ in range(35):
        index.add(chars(A, B, D))
    assert follow(index, [A, B], start=False) == [D]  # the last MAX_VOTES: all D


def test_the_tail_is_matched_on_at_most_max_match_tokens():
    long = list(range(200, 200 + MAX_MATCH + 10))
    index = SuffixIndex(10_000)
    index.add(chars(*long, A))
    assert follow(index, long) == [A]  # its last MAX_MATCH tokens match, the start is not asked for


def test_the_budget_keeps_the_newest_outputs():
    index = SuffixIndex(40)
    for i in range(30):
        assert index.add(chars(A, B, 300 + i))
    assert index.items <= 40 and index.outputs == index.items // 3
    assert index.text.endswith(chars(A, B, 329) + "\x00")  # the newest survived
    assert chars(300) not in index.text  # the oldest left
    before = index.text
    assert not index.add(chars(*range(41)))  # over the budget alone: refused, nothing lost
    assert not index.add("")
    assert index.text == before


# --- layout -------------------------------------------------------------------------------


def test_layout_keeps_structure_and_keys_and_hides_values():
    text = '{\n  "merchant": "Ana \\"B\\"",\n  "total": -12.5e3, "ok": true,\n  "items": [{"name": "x"}], "y": "ab'
    assert layout(text) == ('{\n  "merchant": "' + STRING_HOLE + '",\n  "total": ' + NUMBER_HOLE + ', "ok": true,\n'
                            '  "items": [{"name": "' + STRING_HOLE + '"}], "y": "' + STRING_HOLE)
    assert layout('["a", 1, {"k": "v"}]') == f'["{STRING_HOLE}", {NUMBER_HOLE}, {{"k": "{STRING_HOLE}"}}]'


def layout_after(history: History, text: str) -> tuple[str, str | None]:
    scan = JsonScan().feed(text)
    return history.layout_after(scan.layout, scan.layout_len < MAX_MATCH, 64)[:2]


def test_a_scan_fed_in_pieces_equals_one_fed_whole():
    text = '{"a": "x\\"y", "b": [1, -2.5e3, true], "c": {"d": "long value here", "e": null}, "f": "tail'
    whole = JsonScan().feed(text)
    pieces = JsonScan()
    for i in range(0, len(text), 3):
        pieces = pieces.copy().feed(text[i:i + 3])
    assert (pieces.layout, pieces.layout_len, pieces.state) == (whole.layout, whole.layout_len, whole.state)
    assert whole.state.value == "tail" and whole.state.previous == "long value here"
    assert layout(text).endswith(whole.layout) and len(layout(text)) == whole.layout_len


def test_the_layout_after_a_value_is_learned_whatever_the_value():
    history = History(10_000)
    for name, price in (("Tea", "3.10"), ("Coffee beans", "12"), ("Milk", "0.99")):
        text = f'{{\n  "name": "{name}",\n  "price": {price}\n}}'
        history.learn(list(range(1, len(text) + 1)), text)
    # inside a value: its end, and what follows it
    assert layout_after(history, '{\n  "name": "Soda') == ('",\n  "price": ', NUMBER_HOLE)
    assert layout_after(history, '{\n  "name": "Soda"') == (',\n  "price": ', NUMBER_HOLE)
    assert layout_after(history, '') == ('{\n  "name": "', STRING_HOLE)
    assert layout_after(history, '{\n  "name": "Soda",\n  "price": 7') == ("\n}", None)


# --- the store: keys, budgets -------------------------------------------------------------


def test_keys_never_share_outputs():
    store = SuffixStore(1 << 20, 1000)
    store.learn("tenant-a/schema", [A, B, C], "abc")
    store.learn("tenant-b/schema", [A, B, D], "abd")
    assert store.get("tenant-a/schema").continuation([A, B], 4).tokens == [C]
    assert store.get("tenant-b/schema").continuation([A, B], 4).tokens == [D]
    assert store.get("tenant-c/schema").continuation([A, B], 4) is None


def test_the_total_budget_evicts_the_least_recently_used_key():
    one = History(100_000)
    one.learn(list(range(1000, 1500)), "x" * 500)
    per_key = one.nbytes
    store = SuffixStore(int(per_key * 2.5), 100_000)
    for key in ("a", "b"):
        store.learn(key, list(range(1000, 1500)), "x" * 500)
    store.get("a")  # used: "b" is now the least recent
    store.learn("c", list(range(1000, 1500)), "x" * 500)
    assert "a" in store and "c" in store and "b" not in store
    assert store.nbytes <= store.total_bytes


def test_one_key_over_the_total_keeps_its_newest_outputs():
    store = SuffixStore(4000, 100_000)
    for i in range(40):
        store.learn("only", [A, B, 300 + i] * 30, "ab" * 45)
    history = store.get("only")
    assert store.nbytes <= 4000 and 0 < history.outputs < 40
    assert history.continuation([A, B, 339, A, B], 1).tokens == [339]


# --- in the engine ------------------------------------------------------------------------


def options(strategy: str, draft_len: int = 8, max_tokens: int = 256) -> RequestOptions:
    return RequestOptions(strategy=strategy, draft_len=draft_len, max_tokens=max_tokens)


@pytest.fixture
def fresh_histories(tiny_engine):
    from structspec.engine.proposers.suffix import SuffixStore as Store

    saved = tiny_engine.histories
    tiny_engine.histories = Store(64 << 20, 65536)
    yield tiny_engine
    tiny_engine.histories = saved


@pytest.mark.parametrize("strategy", ["suffix", "composite"])
@pytest.mark.parametrize("draft_len", [1, 3, 8, 16])
def test_drafts_from_an_earlier_output_are_accepted_and_change_nothing(fresh_histories, strategy, draft_len):
    engine = fresh_histories
    base = engine.extract(RECEIPT, RECEIPT_TEXT, options("none", 0))
    assert base.status == "succeeded"
    cold = engine.extract(RECEIPT, RECEIPT_TEXT, options(strategy, draft_len), history=f"k{strategy}{draft_len}")
    warm = engine.extract(RECEIPT, RECEIPT_TEXT, options(strategy, draft_len), history=f"k{strategy}{draft_len}")
    assert cold.tokens == base.tokens and warm.tokens == base.tokens
    # the first run taught the second: its whole output was drafted from memory
    assert warm.stats.accepted > cold.stats.accepted and warm.stats.target_passes < cold.stats.target_passes
    if strategy == "suffix":
        assert cold.stats.proposed == 0  # nothing learned yet: nothing drafted
        assert warm.stats.target_passes <= -(-len(base.tokens) // (draft_len + 1)) + 1


def test_drafts_learned_from_other_documents_change_nothing(fresh_histories):
    engine = fresh_histories
    docs = [RECEIPT_TEXT, "CORNER CAFE\nDate: 2024-01-02\nTOTAL 9.10\nPaid by cash",
            "BOOK NOOK\nDate: 2022-11-30\nTOTAL 120.00\nvoucher", "KIOSK 7\n2021-06-06 total 3.50 card"]
    bases = [engine.extract(RECEIPT, doc, options("none", 0)) for doc in docs]
    for strategy in ("suffix", "composite"):
        for doc, base in zip(docs, bases):
            res = engine.extract(RECEIPT, doc, options(strategy), history=f"docs-{strategy}")
            assert res.tokens == base.tokens, (strategy, doc)
        succeeded = sum(b.status == "succeeded" for b in bases)
        assert succeeded and engine.histories.get(f"docs-{strategy}").outputs == succeeded


def test_only_succeeded_outputs_of_a_named_history_are_learned(fresh_histories):
    engine = fresh_histories
    engine.extract(RECEIPT, RECEIPT_TEXT, options("composite"))  # no history: nothing kept anywhere
    assert len(engine.histories) == 0
    cut = engine.extract(RECEIPT, RECEIPT_TEXT, options("composite", max_tokens=5), history="h")
    assert cut.status == "truncated" and engine.histories.get("h").outputs == 0
    engine.extract(RECEIPT, RECEIPT_TEXT, options("composite"), history="h")
    assert engine.histories.get("h").outputs == 1


def test_a_seed_builds_an_empty_history_and_is_ignored_once_it_holds_outputs(fresh_histories):
    engine = fresh_histories
    base = engine.extract(RECEIPT, RECEIPT_TEXT, options("none", 0))
    res = engine.extract(RECEIPT, RECEIPT_TEXT, options("suffix"), history="seeded", history_seed=[base.text])
    assert res.tokens == base.tokens and res.stats.accepted > 0  # drafted from the seed at once
    assert engine.histories.get("seeded").outputs == 2  # the seed and this output
    engine.extract(RECEIPT, RECEIPT_TEXT, options("suffix"), history="seeded", history_seed=["{}"] * 5)
    assert engine.histories.get("seeded").outputs == 3


def test_with_the_memory_off_suffix_drafts_nothing(tiny_engine):
    saved = tiny_engine.histories
    tiny_engine.histories = None
    try:
        res = tiny_engine.extract(RECEIPT, RECEIPT_TEXT, options("suffix"), history="h", history_seed=["{}"])
    finally:
        tiny_engine.histories = saved
    assert res.status == "succeeded" and res.stats.proposed == 0


def test_auto_never_picks_suffix_with_the_memory_off():
    from structspec.config import Settings
    from structspec.services.strategy import selector_config

    assert "suffix" in selector_config(Settings()).strategies
    assert "suffix" not in selector_config(Settings(engine_suffix_mb=0)).strategies
    assert "composite" in selector_config(Settings(engine_suffix_mb=0)).strategies


@pytest.mark.parametrize("env, named", [({"STRUCTSPEC_ENGINE_SUFFIX_MB": "-1"}, "STRUCTSPEC_ENGINE_SUFFIX_MB"),
                                        ({"STRUCTSPEC_ENGINE_SUFFIX_SCHEMA_TOKENS": "0"},
                                         "STRUCTSPEC_ENGINE_SUFFIX_SCHEMA_TOKENS")])
def test_a_memory_setting_out_of_range_is_refused_naming_it(env, named):
    from structspec.config import Settings, SettingsError

    with pytest.raises(SettingsError, match=named):
        Settings.from_env(env)
