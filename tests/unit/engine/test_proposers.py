"""Proposers draft the right things and never disturb the grammar state."""

from __future__ import annotations

import json

import pytest

from structspec.engine.proposers import DocumentIndex, DraftContext, make_proposer
from structspec.engine.proposers.base import string_state
from structspec.engine.tokens import token_text
from structspec.grammar import GrammarCache, make_backend

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "kind": {"enum": ["alpha", "beta"]}},
          "required": ["name", "kind"]}


@pytest.fixture(scope="module")
def ctx_for(tokenizer):
    tt = token_text(tokenizer, len(tokenizer))
    caches = {ws: GrammarCache(make_backend("llguidance", tokenizer, whitespace=ws)) for ws in ("compact", "flexible")}

    def build(prefix: str, document: str = "Contact: Elena Rodriguez, alpha team.", schema=SCHEMA,
              whitespace: str = "compact"):
        matcher = caches[whitespace].get(schema).matcher()
        ids = tt.encode(prefix)
        assert matcher.consume(ids), prefix
        return DraftContext(matcher=matcher, output_text=prefix, document=DocumentIndex(document), tokens=tt,
                            output_tokens=ids)
    return build


def draft_text(ctx, strategy, k=16):
    return ctx.tokens.text_of(make_proposer(strategy).propose(ctx, k))


def test_schema_proposer_drafts_forced_structure(ctx_for):
    assert draft_text(ctx_for(""), "schema") == '{"name":"'
    assert draft_text(ctx_for('{"name":"Bob"'), "schema") == ',"kind":"'


def test_schema_proposer_stops_at_each_whitespace_gap_in_flexible_mode(ctx_for):
    # a gap may follow "{", each key, colon and comma, so only the bytes up to it are forced,
    # and inside a gap (more whitespace may come) nothing is
    assert draft_text(ctx_for("", whitespace="flexible"), "schema") == "{"
    assert draft_text(ctx_for('{\n  "name": "Bob",\n  ', whitespace="flexible"), "schema") == ""
    assert draft_text(ctx_for('{\n  "name": "Bob",\n  "k', whitespace="flexible"), "schema") == 'ind"'
    assert draft_text(ctx_for('{"name":"Bob","kind":"a', whitespace="flexible"), "schema") == 'lpha"'


def test_schema_proposer_completes_enum_after_unique_prefix(ctx_for):
    assert draft_text(ctx_for('{"name":"Bob","kind":"a'), "schema") == 'lpha"}'


def test_ngram_proposer_copies_document_continuation(ctx_for):
    text = draft_text(ctx_for('{"name":"Elena'), "ngram", k=3)
    assert text.startswith(" Rodriguez")


def test_composite_chains_copied_value_and_forced_structure(ctx_for):
    schema = {"type": "object", "properties": {"year": {"type": "integer"}, "name": {"type": "string"}},
              "required": ["year", "name"]}
    ctx = ctx_for('{"year":202', "It was released in 2023, directed by Elena.", schema)
    # "3," is copied from the document (the grammar cuts the copy at " directed"),
    # then the next key is forced: both in one draft (and nothing after it: in the document
    # "2023" is followed by ", directed", not by a line's or a column's end, so the next value
    # is not guessed from there)
    assert draft_text(ctx, "composite") == '3,"name":"'
    assert draft_text(ctx, "ngram") == "3,"


def test_proposers_leave_the_matcher_unchanged(ctx_for):
    import torch

    for strategy in ("schema", "ngram", "composite"):
        ctx = ctx_for('{"name":"Elena')
        before = torch.zeros((1, (ctx.tokens.vocab_size + 31) // 32), dtype=torch.int32)
        after = before.clone()
        ctx.matcher.fill_bitmask(before, 0)
        make_proposer(strategy).propose(ctx, 8)
        ctx.matcher.fill_bitmask(after, 0)
        assert torch.equal(before, after), strategy


def test_draft_never_exceeds_k(ctx_for):
    for strategy in ("schema", "ngram", "composite"):
        for k in (0, 1, 3):
            assert len(make_proposer(strategy).propose(ctx_for(""), k)) <= k


def test_document_index_matches_json_escaped_text():
    doc = 'He said "hi"\nthen left \\ quietly. Café Ünïcode'
    index = DocumentIndex(doc)
    assert index.text == json.dumps(doc, ensure_ascii=False)[1:-1]
    assert index.continuation('"said \\"h', 6) == 'i\\"\\nt'
    assert index.continuation('x":"Caf', 8) == "é Ünïcod"


def test_document_index_prefers_longest_match_and_searches_output():
    index = DocumentIndex("the cat sat. the cow ran.")
    assert index.continuation("xx the co", 4) == "w ra"
    assert index.continuation('["zq1","zq1","z', 5) == 'q1","'  # only in the output itself
    assert index.continuation("qqq", 5) == ""


def test_unknown_strategy_is_rejected():
    with pytest.raises(ValueError, match="unknown strategy 'fast'"):
        make_proposer("fast")


@pytest.mark.parametrize("prefix, value, previous", [
    ('{"name":"Ele', "Ele", ""),
    ('{"na', None, ""),  # in a key
    ('{"name":"Bob","kind":"a', "a", "Bob"),
    ('{"a":[{"b":"x"},"y\\"z', 'y\\"z', "x"),  # array items are values; escapes stay escaped
    ('{"a":["p","q"],"', None, "q"),  # a key after an array
    ('{"a":"x\\\\","b":1', None, "x\\\\"),  # an escaped backslash ends the string
])
def test_string_state_tells_values_from_keys(prefix, value, previous):
    state = string_state(prefix)
    assert (state.value, state.previous) == (value, previous)


def test_spans_prefer_occurrences_after_the_previous_value():
    index = DocumentIndex("Bob Smith paid. Bob Jones left. Bob Smith came back.")
    assert index.spans("Bob", 6) == [" Smith", " Jones"]  # distinct continuations, document order
    assert index.spans("Bob", 6, after=index.end_of("paid.")) == [" Jones", " Smith"]
    assert index.spans("Nobody", 6) == []


VERBATIM_SCHEMA = {"type": "object", "properties": {"payer": {"type": "string"}, "leaver": {"type": "string"}},
                   "required": ["payer", "leaver"]}
RECEIPT = "Bob Smith paid. Jo Jones left. Bob Smith came back."


def verbatim_ctx(tokenizer, prefix: str, verbatim: bool = True) -> DraftContext:
    tt = token_text(tokenizer, len(tokenizer))
    matcher = GrammarCache(make_backend("llguidance", tokenizer)).get_for(VERBATIM_SCHEMA, RECEIPT, True).matcher()
    assert matcher.consume(tt.encode(prefix)), prefix
    return DraftContext(matcher=matcher, output_text=prefix, document=DocumentIndex(RECEIPT), tokens=tt,
                        verbatim=verbatim)


def test_verbatim_lookup_drafts_a_value_too_short_for_the_free_lookup(tokenizer):
    # "Jo" is shorter than the free lookup's 3 characters and '"Jo' is not in the output: nothing.
    assert draft_text(verbatim_ctx(tokenizer, '{"payer":"Bob Smith","leaver":"Jo', verbatim=False), "ngram") == ""
    # Verbatim: the value is a document span, so "Jo" is looked up whole in the document.
    assert draft_text(verbatim_ctx(tokenizer, '{"payer":"Bob Smith","leaver":"Jo'), "ngram", k=3).startswith(" Jones")


def test_the_usual_match_wins_over_document_spans(tokenizer):
    # '"Bo' matches the output (the previous value): a repeat is what the usual lookup drafts,
    # and verbatim mode keeps it (it matches more context than the value alone).
    text = draft_text(verbatim_ctx(tokenizer, '{"payer":"Bob Smith","leaver":"Bo'), "ngram", k=4)
    assert text.startswith("b Smith")


def test_spans_follow_the_previous_value(tokenizer):
    index = DocumentIndex(RECEIPT)
    assert index.spans("Bob", 8, after=index.end_of("Jo Jones")) == [" Smith c", " Smith p"]


def test_the_grammar_picks_among_candidate_spans(tokenizer):
    # A patterned field keeps its own grammar in a verbatim request. "AB" occurs twice; the
    # first place goes on "-x1", which the pattern refuses after "-", the second "-12".
    schema = {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]+-[0-9]+$"}},
              "required": ["code"]}
    document = "ref AB-x1, code AB-12."
    tt = token_text(tokenizer, len(tokenizer))
    matcher = GrammarCache(make_backend("llguidance", tokenizer)).get_for(schema, document, True).matcher()
    prefix = '{"code":"AB'
    assert matcher.consume(tt.encode(prefix))
    ctx = DraftContext(matcher=matcher, output_text=prefix, document=DocumentIndex(document), tokens=tt,
                       verbatim=True)
    assert ctx.document.spans("AB", 12)[0].startswith("-x1")
    assert draft_text(ctx, "ngram", k=3).startswith("-12")


def test_composite_notes_how_sure_each_stretch_of_its_draft_is(ctx_for):
    from structspec.engine.proposers.suffix import History

    ctx = ctx_for('{\n  "name": "Bob"', whitespace="flexible")
    history = History(10_000)
    for name, kind in (("Ann", "alpha"), ("Cy", "beta"), ("Di", "beta")):
        text = f'{{\n  "name": "{name}",\n  "kind": "{kind}"\n}}'
        history.learn(ctx.tokens.encode(text), text)
    ctx.history = history
    draft = make_proposer("composite").propose(ctx, 16)
    stretch = ctx.tokens.encode(',\n  "kind": "')
    assert draft[:len(stretch)] == stretch  # the layout the three earlier outputs agree on
    assert len(ctx.confidence) == len(draft)
    # its share of the voters on its first token ((3 + 1) / (3 + 2)), then 1.0: the product over
    # any prefix of the stretch is its share
    assert ctx.confidence[:len(stretch)] == [4 / 5] + [1.0] * (len(stretch) - 1)
    # then, at the value's start, the value two of the three wrote, with its share ((2 + 1) / (3 + 2)),
    # and what they all wrote after it
    rest = ctx.tokens.encode('beta"\n}')
    assert draft[len(stretch):] == rest
    assert ctx.confidence[len(stretch):] == [3 / 5] + [1.0] * (len(rest) - 1)
    # a forced stretch or a copy says nothing of how sure it is
    ctx = ctx_for('{"name":"Bob"')
    draft = make_proposer("composite").propose(ctx, 16)
    assert ctx.tokens.text_of(draft) == ',"kind":"' and ctx.confidence == [None] * len(draft)


# --- composite: the output's own layout, the document's next value, stretches tokenized together


ITEMS = {"type": "object", "properties": {"items": {"type": "array", "items": {
    "type": "object", "properties": {"name": {"type": "string"}, "price": {"type": "number"}},
    "required": ["name", "price"]}}}, "required": ["items"]}
TILL = "Flat white          3.40\nAlmond croissant    2.95\nOrange juice        2.50\n"
TWO_ITEMS = ('{\n  "items": [\n    {\n      "name": "Flat white",\n      "price": 3.40\n    },\n    {\n      '
             '"name": "Almond croissant",\n      "price": 2.95\n    },')


def test_after_value_is_the_documents_next_field_past_blanks_and_line_breaks():
    index = DocumentIndex(TILL)
    assert index.after_value("Flat white", "", 4) == "3.40"
    assert index.after_value("3.40", "Flat white", 16) == "Almond croissant"
    # a value met twice: its occurrence after the value written before it
    index = DocumentIndex("Tea  2.50\nCake  2.50\nJam  1.10")
    assert index.after_value("2.50", "Cake", 3) == "Jam"
    assert index.after_value("2.50", "", 4) == "Cake"
    assert index.after_value("2023", "", 8) == ""  # absent
    assert DocumentIndex("in 2023, directed by").after_value("2023", "", 8) == ""  # mid-sentence
    assert index.after_value("J", "", 8) == ""  # too short to place


def test_composite_drafts_the_next_item_from_the_document_in_the_layout_of_the_last(ctx_for):
    # with no earlier outputs: the layout of the item before (its keys, its indentation) and the
    # document's next line, the item after the last one written
    ctx = ctx_for(TWO_ITEMS, TILL, ITEMS, whitespace="flexible")
    text = draft_text(ctx, "composite", k=32)
    assert text.startswith('\n    {\n      "name": "Orange juice",\n      "price": 2.50')
    # inside it: the price that follows the name in the document, after the blank this output
    # puts after a colon
    ctx = ctx_for(TWO_ITEMS + '\n    {\n      "name": "Orange juice",\n      "price":', TILL, ITEMS,
                  whitespace="flexible")
    assert draft_text(ctx, "composite", k=12).startswith(" 2.50\n    },")  # and the item's end


def test_composite_drafts_a_keys_quote_and_colon_as_the_model_writes_them(ctx_for):
    # the grammar forces the key and its quote; the layout of the key before puts ": " after it;
    # tokenized one stretch at a time that is '"' then ': "', which no model writes
    ctx = ctx_for('{\n  "name": "Bob",\n  "ki', whitespace="flexible")
    draft = make_proposer("composite").propose(ctx, 8)
    assert ctx.tokens.text_of(draft).startswith('nd": "')
    assert draft == ctx.tokens.encode('nd": "')[:len(draft)]
    assert len(ctx.confidence) == len(draft)


def test_composite_prefers_this_outputs_layout_to_earlier_outputs_where_it_matches_as_much(ctx_for):
    from structspec.engine.proposers.suffix import History

    history = History(10_000)
    for name in ("Ann", "Cy", "Di"):  # earlier outputs indented items by two
        text = f'{{\n  "items": [\n  {{\n  "name": "{name}",\n  "price": 1\n  }},\n  {{\n  "name": "X",\n  "price": 2\n  }}\n  ]\n}}'
        history.learn(make_tokens(ctx_for, text), text)
    ctx = ctx_for(TWO_ITEMS + '\n    {\n      "name": "Tea"', "no lines here", ITEMS, whitespace="flexible")
    ctx.history = history
    assert draft_text(ctx, "composite", k=16).startswith(',\n      "price": ')  # this output's six blanks


def make_tokens(ctx_for, text: str) -> list[int]:
    return ctx_for("").tokens.encode(text)


def test_number_after_is_the_documents_next_standalone_number():
    index = DocumentIndex("Bandages   4.79\nHand cream   7.25\nCough syrup   11.30\nSPF50 cream   P120   5.00")
    assert index.number_after("4.79") == "7.25"
    assert index.number_after("7.25") == "11.30"  # after a line break, escaped in the index's text
    assert index.number_after("11.30") == "5.00"  # not the digits inside "SPF50" or "P120"
    assert index.number_after("5.00") == "" and index.number_after("9.99") == "" and index.number_after("") == ""


def test_composite_drafts_the_next_price_after_a_name_the_document_does_not_hold(ctx_for):
    # the model wrote a name of its own: nothing follows it in the document, but the prices are
    # a column, written in its order
    ctx = ctx_for(TWO_ITEMS + '\n    {\n      "name": "Mystery",\n      "price":', TILL, ITEMS, whitespace="flexible")
    assert draft_text(ctx, "composite", k=8).startswith(" 2.50")


def test_at_a_values_start_what_most_earlier_outputs_wrote_comes_before_the_documents_next_line(ctx_for):
    from structspec.engine.proposers.suffix import History

    schema = {"type": "object", "properties": {"merchant": {"type": "string"}, "date": {"type": "string"}},
              "required": ["merchant", "date"]}
    history = History(10_000)
    tokens = ctx_for("").tokens
    for day in ("01", "02", "03"):
        text = f'{{\n  "merchant": "Shop",\n  "date": "2025-01-{day}"\n}}'
        history.learn(tokens.encode(text), text)
    document = "Corner Cafe\n12 High Street\n2025-03-01 10:00"
    ctx = ctx_for('{\n  "merchant": "Corner Cafe",\n  "date": "', document, schema, whitespace="flexible")
    assert draft_text(ctx, "composite").startswith("12 High")  # no memory: the document's next line
    ctx = ctx_for('{\n  "merchant": "Corner Cafe",\n  "date": "', document, schema, whitespace="flexible")
    ctx.history = history
    assert draft_text(ctx, "composite").startswith("2025-01-0")  # the three earlier outputs agree on it
