"""Prompt lookup: draft what followed the longest earlier match of the output's tail."""

from __future__ import annotations

from structspec.engine.proposers.base import DraftContext, consume_valid_prefix, string_state

CHARS_PER_TOKEN = 6  # generous: take enough text to tokenize k tokens from it
MIN_SPAN_CHARS = 2  # a verbatim value this long is looked up whole (a 1-char one matches everywhere)


def lookup_step(ctx: DraftContext, tail: str, budget: int) -> list[int]:
    """Consume (into ctx.matcher) the grammar-valid prefix of the copied continuation."""
    if budget <= 0:
        return []
    n_chars = budget * CHARS_PER_TOKEN
    candidates = []
    if ctx.verbatim:
        candidates = span_candidates(ctx, tail, n_chars)
    usual = ctx.document.continuation(tail, n_chars)
    if usual and usual not in candidates:
        candidates.append(usual)
    if len(candidates) == 1:
        return consume_valid_prefix(ctx.matcher, ctx.tokens.encode(candidates[0])[:budget])
    # The grammar picks: the candidate with the longest valid prefix wins (the first on a tie).
    best: list[int] = []
    for text in candidates:
        tokens = ctx.tokens.encode(text)[:budget]
        valid = ctx.matcher.validate(tokens)
        if valid > len(best):
            best = tokens[:valid]
    return consume_valid_prefix(ctx.matcher, best)


def span_candidates(ctx: DraftContext, tail: str, n_chars: int) -> list[str]:
    """Inside a string value of a verbatim request: the document's continuation at each place
    the whole value so far occurs (a verbatim value is a document span, so its match is the
    value itself, however short or long), nearest after the previous value first."""
    state = string_state(tail)
    if state.value is None or len(state.value) < MIN_SPAN_CHARS:
        return []
    return ctx.document.spans(state.value, n_chars, after=ctx.document.end_of(state.previous))


class NgramProposer:
    name = "ngram"

    def propose(self, ctx: DraftContext, k: int) -> list[int]:
        draft: list[int] = []
        try:
            draft = lookup_step(ctx, ctx.output_text, k)
        finally:
            ctx.matcher.rollback(len(draft))
        return draft
