"""Prompt lookup: draft what followed the longest earlier match of the output's tail."""

from __future__ import annotations

from structspec.engine.proposers.base import DraftContext, consume_valid_prefix, string_state

CHARS_PER_TOKEN = 6  # generous: take enough text to tokenize k tokens from it
MIN_SPAN_CHARS = 2  # a verbatim value this long is looked up whole (a 1-char one matches everywhere)


def lookup_step(ctx: DraftContext, tail: str, budget: int) -> list[int]:
    """Consume (into ctx.matcher) the grammar-valid prefix of the copied continuation.

    The usual candidate is the longest match of the tail in the document or the output. In a
    verbatim request, the document's continuations of the string value being written follow
    it; the grammar picks the candidate with the longest valid prefix, the earlier on a tie. The
    usual candidate goes first because it matches more context (the key, earlier structure):
    the default model's loops repeat whole values, which the value alone cannot tell apart from
    the document's next occurrence (bench strategies, verbatim mode: spans first cost 0.26
    tokens/pass against none, see docs/benchmarks.md)."""
    if budget <= 0:
        return []
    n_chars = budget * CHARS_PER_TOKEN
    usual = ctx.document.continuation(tail, n_chars)
    candidates = [usual] if usual else []
    if ctx.verbatim:
        candidates += [c for c in span_candidates(ctx, tail, n_chars) if c != usual]
    if len(candidates) == 1:
        return consume_valid_prefix(ctx.matcher, ctx.tokens.encode(candidates[0])[:budget])
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
