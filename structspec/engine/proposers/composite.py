"""Forced structure, learned structure and copied values chained in one draft.

Each round drafts what the grammar forces, then:
- between values: the layout that follows this one (keys, whitespace, punctuation, up to where
  the next value's content begins) as this output continued it before (array items repeat their
  layout) or as the schema's earlier outputs continue it (suffix.py), whichever matched more;
  else the earlier outputs' token continuation where most of them agree on it; else, where a
  value comes next, the document's next value; else a copy (ngram.py);
- at a string value's start: what most earlier outputs wrote there (a date's century, an
  enum), else the value the document holds next after the output's last one
  (DocumentIndex.after_value: array items, and fields, are mostly extracted in the document's
  order, so the next item's name follows the last item's price); where a number comes and the
  document holds none there, its next number after the output's last one (a column of prices);
- inside a value: the document's text after the longest match of the tail (the value being
  copied).
A value drafted from the document that reaches its likely end (a line break, a run of spaces)
is closed there and followed by the layout, so that one pass can accept the rest of the value
and the structure up to the next one. Stretches are tokenized one by one, and where the last
token of one and the next stretch tokenize differently together (a key's `"` and its `:` as
`":`), they are drafted as the model would write them.

Earlier outputs' *values* are not drafted here beyond a value's start (`suffix` drafts them):
measured on receipts, such drafts inside values were accepted 7% of the time, and in a batch every
refused draft token is a row of the forward pass (docs/benchmarks.md); with agreement required,
inside values they still cost more rows than they saved passes (`python -m bench.drafts --memory`).
"""

from __future__ import annotations

import re

from structspec.engine.proposers.base import (NUMBER, DraftContext, JsonScan, consume_valid_prefix,
                                              longest_suffix_match, note_confidence, scan_of, split_at_hole)
from structspec.engine.proposers.ngram import CHARS_PER_TOKEN, lookup_step
from structspec.engine.proposers.schema import forced_step
from structspec.engine.proposers.suffix import MAX_MATCH, Continuation, suffix_continuation

# where a copied string value likely ends in the (JSON-escaped) document: a line break, a tab,
# a run of spaces (columns); a number ends at its first character that is not part of one
STRING_END = re.compile(r"\\[nrt]| {2,}")
NUMBER_END = re.compile(r"[^0-9.eE+-]")
KEY_GAP = re.compile(r'"(\s*:[ \t]*)')  # in a layout (string values are holes): a key's colon and its blanks


def agreed(learned: Continuation) -> bool:
    """Whether earlier outputs agree enough on a token continuation to draft it beside the other
    sources: most of its voters, and more than one."""
    return learned.agreeing >= 2 and 2 * learned.agreeing > learned.votes


class CompositeProposer:
    name = "composite"

    def propose(self, ctx: DraftContext, k: int) -> list[int]:
        draft: list[int] = []
        try:
            while len(draft) < k:
                forced = forced_step(ctx, k - len(draft))
                draft = joined(ctx, draft, forced, None)
                step, share = self._step(ctx, draft, k - len(draft))
                draft = joined(ctx, draft, step, share)
                if not forced and not step:
                    break
        finally:
            ctx.matcher.rollback(len(draft))
        return draft

    @staticmethod
    def _step(ctx: DraftContext, draft: list[int], budget: int) -> tuple[list[int], float | None]:
        """The next stretch of the draft and how sure it is (a learned one: its share of the
        voters; a copy: None)."""
        if budget <= 0:
            return [], None
        tail = ctx.output_text + ctx.tokens.text_of(draft) if draft else ctx.output_text
        n_chars = budget * CHARS_PER_TOKEN
        scan = scan_of(ctx, tail)
        in_string = scan.in_string and scan.is_value
        if not in_string and not scan.in_number:  # between values: the layout first
            text, share = layout_after(ctx, scan, n_chars)
            step = consume_valid_prefix(ctx.matcher, ctx.tokens.encode(text)[:budget]) if text else []
            if not step:
                step, share = learned_step(ctx, draft, budget)
            if not step and scan.at_value:  # after the blanks the layout puts before a value
                step, share = next_value_step(ctx, scan, budget, text[:len(text) - len(text.lstrip())]), None
            return (step, share) if step else (lookup_step(ctx, tail, budget), None)
        if in_string and not scan.value:  # a value's start: what most earlier outputs wrote there, else the document's next value
            step, share = learned_step(ctx, draft, budget)
            if step:
                return step, share
            if step := next_value_step(ctx, scan, budget):
                return step, None
        copied = ctx.document.lookup(tail, n_chars)[1]
        if not copied:  # a verbatim value is looked up whole (ngram.py)
            return (lookup_step(ctx, tail, budget) if ctx.verbatim else []), None
        return consume_valid_prefix(ctx.matcher, ctx.tokens.encode(closed(ctx, scan, copied, n_chars))[:budget]), None


def layout_after(ctx: DraftContext, scan: JsonScan, n_chars: int) -> tuple[str, float | None]:
    """(the layout likely to follow `scan`'s, up to where the next value's content begins; how
    sure it is): as this output continued the same layout before (its latest earlier occurrence:
    array items, and objects of one schema, repeat their keys and indentation), or as most of
    the schema's earlier outputs continue it (suffix.py), whichever matched more of it (a tie:
    this output's own, whose indentation is this output's)."""
    own = scan.layout
    matched, _ = longest_suffix_match(own[:-1], own, 2, MAX_MATCH)
    if ctx.history is not None:
        text, _, share, learned = ctx.history.layout_after(own, scan.layout_len < MAX_MATCH, n_chars)
        if text and learned > matched:
            return text, share
    if not matched:  # a key's first time: what followed the keys before it (`": `)
        gaps = KEY_GAP.findall(own[:-1]) if scan.expect_key and own.endswith('"') else []
        return (gaps[-1] if gaps else ""), None
    start = own.rfind(own[-matched:], 0, len(own) - 1) + matched
    return split_at_hole(own[start:start + n_chars])[0], None


def learned_step(ctx: DraftContext, draft: list[int], budget: int) -> tuple[list[int], float | None]:
    """Consume (into ctx.matcher) the grammar-valid prefix of the earlier outputs' token
    continuation of the output and `draft` where most of them agree on it (`agreed`); (it, its
    share), or ([], None)."""
    learned = suffix_continuation(ctx, draft, budget)
    if learned is None or not agreed(learned):
        return [], None
    return consume_valid_prefix(ctx.matcher, learned.tokens), learned.share


def closed(ctx: DraftContext, scan: JsonScan, text: str, n_chars: int) -> str:
    """`text` (the rest of the value `scan` ends in) up to the value's likely end (STRING_END,
    NUMBER_END), closed there and followed by the layout likely to follow it; a number whose
    layout nothing shows, and a value that shows no end, as they are (the grammar cuts them)."""
    in_string = scan.in_string
    end = (STRING_END if in_string else NUMBER_END).search(text)
    if end is None:
        return text
    value = text[:end.start()] + ('"' if in_string else "")
    after = layout_after(ctx, scan.copy().feed(value), n_chars)[0]
    return value + after if after or in_string else text


def next_value_step(ctx: DraftContext, scan: JsonScan, budget: int, gap: str = "") -> list[int]:
    """Consume (into ctx.matcher) the grammar-valid prefix of the value the document holds next
    after the output's last one (DocumentIndex.after_value), at the start of a value (`scan` at
    a string value's opening quote, or where a value comes next: after `gap`), closed and
    followed by its likely layout; where that is no value the grammar takes and a number may
    come, the document's next number after the output's last one; [] where neither is found."""
    n_chars = budget * CHARS_PER_TOKEN
    after = ctx.document.after_value(scan.last, scan.before_last, n_chars)
    if scan.in_string:
        return consume_valid_prefix(ctx.matcher, ctx.tokens.encode(closed(ctx, scan, after, n_chars))[:budget]) \
            if after else []
    least = len(ctx.tokens.encode(gap)) if gap else 0

    def taken(text: str) -> list[int]:  # consumed where the grammar takes more than the gap
        tokens = ctx.tokens.encode(gap + text)[:budget]
        return consume_valid_prefix(ctx.matcher, tokens) if ctx.matcher.validate(tokens) > least else []

    if after:
        number = NUMBER.match(after)  # its end is the layout's first character: the layout is not drafted
        step = taken(number.group() if number else '"' + closed(ctx, scan.copy().feed(gap + '"'), after, n_chars))
        if step:
            return step
    return taken(ctx.document.number_after(scan.last_number)) if scan.last_number else []


def joined(ctx: DraftContext, draft: list[int], stretch: list[int], share: float | None) -> list[int]:
    """`draft` followed by `stretch` (both consumed into ctx.matcher), the draft's last token and
    the stretch tokenized together where that tokenizes them differently: each stretch is
    tokenized alone, but a model writes a key's closing quote and its colon as one token (`":`),
    and a value's closing quote and the comma (`",`). Notes the stretch's confidence."""
    if not stretch:
        return draft
    if draft:
        pair = draft[-1:] + stretch
        merged = ctx.tokens.encode(ctx.tokens.text_of(pair))
        if merged != pair and ctx.tokens.bytes_of(merged) == ctx.tokens.bytes_of(pair):
            ctx.matcher.rollback(len(pair))
            ok = ctx.matcher.validate(merged) == len(merged)
            consume_valid_prefix(ctx.matcher, merged if ok else pair)
            if ok:
                last = ctx.confidence.pop() if len(ctx.confidence) == len(draft) else None
                note_confidence(ctx, len(merged), share if share is not None else last)
                return draft[:-1] + merged
    note_confidence(ctx, len(stretch), share)
    return draft + stretch
