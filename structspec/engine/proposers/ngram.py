"""Prompt lookup: draft what followed the longest earlier match of the output's tail."""

from __future__ import annotations

from structspec.engine.proposers.base import DraftContext, consume_valid_prefix, string_state

CHARS_PER_TOKEN = 6  # generous: take enough text to tokenize k tokens from it
MIN_SPAN_CHARS = 2  # a verbatim value this long is looked up whole (a 1-char one matches everywhere)


def lookup_step(ctx: DraftContext, tail: str, budget: int) -> list[int]:
    """Consume (into ctx.matcher) the grammar-valid prefix of the copied continuation.

    The longest match of the tail in the document or the output wins. Where there is none and
    the request is verbatim, the string value being written is looked up whole in the document
    and the grammar picks among its places: the candidate with the longest valid prefix (the
    earlier on a tie). Spans never replace a match: in a verbatim value every span is valid, so
    the grammar cannot tell "the value's next occurrence" from "what followed this key before",
    and the default model mostly repeats earlier values (offering spans first made both ngram
    and composite slower when verbatim drafting was written; that run is not in the docs)."""
    if budget <= 0:
        return []
    n_chars = budget * CHARS_PER_TOKEN
    usual = ctx.document.continuation(tail, n_chars)
    if usual or not ctx.verbatim:
        return consume_valid_prefix(ctx.matcher, ctx.tokens.encode(usual)[:budget]) if usual else []
    best: list[int] = []
    for text in span_candidates(ctx, tail, n_chars):
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
