"""Draft proposers. `none` drafts nothing: plain constrained decoding, the baseline and oracle."""

from __future__ import annotations

from structspec.engine.proposers.base import DocumentIndex, DraftContext, Proposer
from structspec.engine.proposers.composite import CompositeProposer
from structspec.engine.proposers.ngram import NgramProposer
from structspec.engine.proposers.schema import SchemaProposer
from structspec.engine.proposers.suffix import History, SuffixProposer, SuffixStore
from structspec.options import STRATEGIES


class NoProposer:
    name = "none"

    def propose(self, ctx: DraftContext, k: int) -> list[int]:
        return []


PROPOSERS = {"none": NoProposer, "schema": SchemaProposer, "ngram": NgramProposer,
             "suffix": SuffixProposer, "composite": CompositeProposer}
assert tuple(PROPOSERS) == STRATEGIES, "structspec/options.py names the strategies this package implements"


def make_proposer(strategy: str) -> Proposer:
    try:
        return PROPOSERS[strategy]()
    except KeyError:
        raise ValueError(f"unknown strategy {strategy!r}; choose one of {', '.join(PROPOSERS)}") from None


__all__ = ["DocumentIndex", "DraftContext", "Proposer", "PROPOSERS", "STRATEGIES", "History", "SuffixStore",
           "make_proposer"]
