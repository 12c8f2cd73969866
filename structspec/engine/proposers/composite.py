"""Forced structure, learned structure and copied values chained in one draft.

Each round drafts what the grammar forces, then one of:
- between values: the layout the schema's earlier outputs continue this one with (suffix.py:
  keys, whitespace, punctuation, up to where the next value's content begins), else their
  token continuation, else a copy;
- inside a value: from whichever of the two lookups matched the longer tail, the earlier
  outputs' tokens (a recurring value) or the document (ngram.py: the value being copied). A copy
  that reaches a likely end of the value (a line break, a run of spaces) is closed there and
  followed by the layout that follows such a value in earlier outputs, so that one pass can
  accept the rest of the value and the structure up to the next one.
Without earlier outputs this is forced bytes and copies alone.
"""

from __future__ import annotations

import re

from structspec.engine.proposers.base import STRING_HOLE, DraftContext, consume_valid_prefix, scan_of
from structspec.engine.proposers.ngram import CHARS_PER_TOKEN, lookup_step
from structspec.engine.proposers.schema import forced_step
from structspec.engine.proposers.suffix import MAX_MATCH, suffix_continuation

# where a copied string value likely ends in the (JSON-escaped) document: a line break, a tab,
# a run of spaces (columns); a number ends at its first character that is not part of one
STRING_END = re.compile(r"\\[nrt]| {2,}")
NUMBER_END = re.compile(r"[^0-9.eE+-]")
QUOTED = re.compile(r'"(?:[^"\\]|\\.)*"?')
NUMBERS = re.compile(r"-?[0-9]+(?:\.[0-9]+)?")
SEPARATORS = re.compile(r"(?:\\[nrt]|[ :|;,*#=$\u20ac\u00a3])*")  # between a document's values


def next_value(ctx: DraftContext, tail: str, previous: str, string: bool) -> str:
    """A guess at the value the output goes on with: fields are mostly extracted in the
    document's order, so the document's next value after the last one the output wrote (its
    last string value `previous`, then the numbers written since), up to its likely end; a
    string's closing quote included. "" when the guess finds nothing."""
    doc = ctx.document
    at = doc.end_of(previous) if previous else 0
    since = tail.rfind(f'"{previous}"') + len(previous) + 2 if previous else 0
    for number in NUMBERS.findall(QUOTED.sub("", tail[since:])):  # the numbers written since (not in keys)
        found = doc.text.find(number, at)
        if found >= 0:
            at = found + len(number)
    at = SEPARATORS.match(doc.text, at).end()
    if not string:
        number = NUMBERS.match(doc.text, at)
        return number.group() if number else ""
    end = STRING_END.search(doc.text, at, at + 200)
    value = doc.text[at:end.start() if end else at + 200]
    return value + '"' if value and end else value


class CompositeProposer:
    name = "composite"

    def propose(self, ctx: DraftContext, k: int) -> list[int]:
        draft: list[int] = []
        try:
            while len(draft) < k:
                forced = forced_step(ctx, k - len(draft))
                draft += forced
                step = self._step(ctx, draft, k - len(draft))
                draft += step
                if not forced and not step:
                    break
        finally:
            ctx.matcher.rollback(len(draft))
        return draft

    @staticmethod
    def _step(ctx: DraftContext, draft: list[int], budget: int) -> list[int]:
        if budget <= 0:
            return []
        tail = ctx.output_text + ctx.tokens.text_of(draft) if draft else ctx.output_text
        if ctx.history is None:
            return lookup_step(ctx, tail, budget)
        n_chars = budget * CHARS_PER_TOKEN
        scan = scan_of(ctx, tail)
        in_string = scan.in_string and scan.is_value
        learned = suffix_continuation(ctx, draft, budget)
        if not in_string and not scan.in_number:  # between values: the learned layout first
            text, hole = ctx.history.layout_after(scan.layout, scan.layout_len < MAX_MATCH, n_chars)
            if hole is not None:  # and the value it leads to: the document's next one
                text += next_value(ctx, tail, scan.previous, hole == STRING_HOLE)
            step = consume_valid_prefix(ctx.matcher, ctx.tokens.encode(text)[:budget]) if text else []
            if not step and learned is not None:
                step = consume_valid_prefix(ctx.matcher, learned.tokens)
            return step or lookup_step(ctx, tail, budget)
        copied_chars, copied = ctx.document.lookup(tail, n_chars)
        if learned is not None:
            tokens = ctx.output_tokens + draft
            learned_chars = len(ctx.tokens.text_of(tokens[len(tokens) - min(learned.matched, len(tokens)):]))
            learned_chars += learned.matched > len(tokens)  # the output's start matched too
            if learned_chars >= copied_chars:
                step = consume_valid_prefix(ctx.matcher, learned.tokens)
                if step:
                    return step
        if not copied:
            return consume_valid_prefix(ctx.matcher, learned.tokens) if learned is not None else []
        end = (STRING_END if in_string else NUMBER_END).search(copied)
        if end is not None:  # the value's likely end: close it, then what followed such a value before
            copied = copied[:end.start()] + ('"' if in_string else "")
            after = scan.copy().feed(copied)
            copied += ctx.history.layout_after(after.layout, after.layout_len < MAX_MATCH, n_chars)[0]
        return consume_valid_prefix(ctx.matcher, ctx.tokens.encode(copied)[:budget])
