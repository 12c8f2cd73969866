"""Forced structure, learned structure and copied values chained in one draft.

Each round drafts what the grammar forces, then:
- between values: the layout the schema's earlier outputs continue this one with (suffix.py:
  keys, whitespace, punctuation, up to where the next value's content begins), else their
  token continuation where most of them agree on it, else a copy (ngram.py);
- inside a value: the document's text after the longest match of the tail (the value being
  copied). A copy that reaches a likely end of the value (a line break, a run of spaces) is
  closed there and followed by the layout that follows such a value in earlier outputs, so that
  one pass can accept the rest of the value and the structure up to the next one.
Without earlier outputs this is forced bytes and copies alone.

Earlier outputs' *values* are not drafted here (`suffix` alone drafts them): measured on
receipts, such drafts inside values were accepted 7% of the time, and in a batch every refused
draft token is a row of the forward pass (docs/benchmarks.md).
"""

from __future__ import annotations

import re

from structspec.engine.proposers.base import DraftContext, consume_valid_prefix, note_confidence, scan_of
from structspec.engine.proposers.ngram import CHARS_PER_TOKEN, lookup_step
from structspec.engine.proposers.schema import forced_step
from structspec.engine.proposers.suffix import MAX_MATCH, Continuation, suffix_continuation

# where a copied string value likely ends in the (JSON-escaped) document: a line break, a tab,
# a run of spaces (columns); a number ends at its first character that is not part of one
STRING_END = re.compile(r"\\[nrt]| {2,}")
NUMBER_END = re.compile(r"[^0-9.eE+-]")


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
                draft += forced
                note_confidence(ctx, len(forced), None)
                step, share = self._step(ctx, draft, k - len(draft))
                draft += step
                note_confidence(ctx, len(step), share)
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
        if ctx.history is None:
            return lookup_step(ctx, tail, budget), None
        n_chars = budget * CHARS_PER_TOKEN
        scan = scan_of(ctx, tail)
        in_string = scan.in_string and scan.is_value
        if not in_string and not scan.in_number:  # between values: the learned layout first
            text, _, share = ctx.history.layout_after(scan.layout, scan.layout_len < MAX_MATCH, n_chars)
            step = consume_valid_prefix(ctx.matcher, ctx.tokens.encode(text)[:budget]) if text else []
            if not step:
                learned = suffix_continuation(ctx, draft, budget)
                if learned is not None and agreed(learned):
                    step, share = consume_valid_prefix(ctx.matcher, learned.tokens), learned.share
            return (step, share) if step else (lookup_step(ctx, tail, budget), None)
        copied = ctx.document.lookup(tail, n_chars)[1]
        if not copied:  # a verbatim value is looked up whole (ngram.py)
            return (lookup_step(ctx, tail, budget) if ctx.verbatim else []), None
        end = (STRING_END if in_string else NUMBER_END).search(copied)
        if end is not None:  # the value's likely end: close it, then what followed such a value before
            copied = copied[:end.start()] + ('"' if in_string else "")
            after = scan.copy().feed(copied)
            copied += ctx.history.layout_after(after.layout, after.layout_len < MAX_MATCH, n_chars)[0]
        return consume_valid_prefix(ctx.matcher, ctx.tokens.encode(copied)[:budget]), None
