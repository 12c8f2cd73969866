"""Draft what the grammar forces: braces, quotes, commas, property names, enum tails, literals."""

from __future__ import annotations

from structspec.engine.proposers.base import DraftContext, consume_valid_prefix


def forced_step(ctx: DraftContext, budget: int) -> list[int]:
    """Consume (into ctx.matcher) the canonical tokens of the forced bytes; return them.

    Forced *bytes* are not forced *tokens*: the canonical tokenization is only a guess
    that the target verifies (a model may prefer another split).
    """
    forced = ctx.matcher.forced_bytes()
    if not forced or budget <= 0:
        return []
    text = forced.decode("utf-8", errors="ignore")  # a partial UTF-8 tail is left to the model
    return consume_valid_prefix(ctx.matcher, ctx.tokens.encode(text)[:budget])


class SchemaProposer:
    name = "schema"

    def propose(self, ctx: DraftContext, k: int) -> list[int]:
        draft: list[int] = []
        try:
            while len(draft) < k:
                step = forced_step(ctx, k - len(draft))
                if not step:
                    break
                draft += step
        finally:
            ctx.matcher.rollback(len(draft))
        return draft
