"""Prompt lookup: draft what followed the longest earlier match of the output's tail."""

from __future__ import annotations

from structspec.engine.proposers.base import DraftContext, consume_valid_prefix

CHARS_PER_TOKEN = 6  # generous: take enough text to tokenize k tokens from it


def lookup_step(ctx: DraftContext, tail: str, budget: int) -> list[int]:
    """Consume (into ctx.matcher) the grammar-valid prefix of the copied continuation."""
    if budget <= 0:
        return []
    text = ctx.document.continuation(tail, budget * CHARS_PER_TOKEN)
    return consume_valid_prefix(ctx.matcher, ctx.tokens.encode(text)[:budget]) if text else []


class NgramProposer:
    name = "ngram"

    def propose(self, ctx: DraftContext, k: int) -> list[int]:
        draft: list[int] = []
        try:
            draft = lookup_step(ctx, ctx.output_text, k)
        finally:
            ctx.matcher.rollback(len(draft))
        return draft
