"""Forced structure and copied values chained in one draft: `"date":"` then the date itself."""

from __future__ import annotations

from structspec.engine.proposers.base import DraftContext
from structspec.engine.proposers.ngram import lookup_step
from structspec.engine.proposers.schema import forced_step


class CompositeProposer:
    name = "composite"

    def propose(self, ctx: DraftContext, k: int) -> list[int]:
        draft: list[int] = []
        try:
            while len(draft) < k:
                forced = forced_step(ctx, k - len(draft))
                draft += forced
                tail = ctx.output_text + ctx.tokens.text_of(draft) if draft else ctx.output_text
                copied = lookup_step(ctx, tail, k - len(draft))
                draft += copied
                if not forced and not copied:
                    break
        finally:
            ctx.matcher.rollback(len(draft))
        return draft
