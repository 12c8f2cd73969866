"""Invariant 3: with temperature > 0, speculative sampling keeps the target distribution.

The distribution itself is tested in test_batched_sampling.py (exact target, N = 2000, in
batches); here: the shared schema and proposer, and reproducibility by seed.
"""

from __future__ import annotations

import torch

from structspec.options import RequestOptions
from tests.conftest import allowed_tokens

SCHEMA = {
    "type": "object",
    "properties": {"colour": {"enum": ["red", "green", "blue", "yellow"]},
                   "size": {"enum": ["S", "M", "L"]}},
    "required": ["colour", "size"],
}
TEXT = "A red shirt in size M, also sold in blue and green."


class FirstAllowedProposer:
    """Drafts the lowest-id allowed token at each position: deterministic, often wrong,
    so acceptance is genuinely probabilistic (p(x) < 1) at the free choices."""

    name = "first-allowed"

    def propose(self, ctx, k):
        mask = torch.zeros((1, (ctx.tokens.vocab_size + 31) // 32), dtype=torch.int32)
        draft = []
        try:
            while len(draft) < k:
                ctx.matcher.fill_bitmask(mask, 0)
                allowed = allowed_tokens(mask[0], ctx.tokens.hf.all_special_ids)
                if not allowed or not ctx.matcher.consume([allowed[0]]):
                    break
                draft.append(allowed[0])
        finally:
            ctx.matcher.rollback(len(draft))
        return draft


def test_seed_makes_sampling_reproducible_and_other_seeds_sample_otherwise(tiny_engine):
    opts = dict(strategy="composite", draft_len=4, temperature=1.5, max_tokens=32)
    a = tiny_engine.extract(SCHEMA, TEXT, RequestOptions(seed=7, **opts))
    b = tiny_engine.extract(SCHEMA, TEXT, RequestOptions(seed=7, **opts))
    assert a.tokens == b.tokens
    # The same seed agreeing proves nothing if the seed were ignored or sampling fell back to
    # greedy: other seeds must draw other outputs (12 colour x size values; a seed-blind engine
    # gives one), and greedy must not be all that is ever drawn.
    values = {tuple(tiny_engine.extract(SCHEMA, TEXT, RequestOptions(seed=s, **opts)).tokens) for s in range(8)}
    greedy = tiny_engine.extract(SCHEMA, TEXT, RequestOptions(**{**opts, "temperature": 0.0})).tokens
    assert len(values) >= 3 and values != {tuple(greedy)}, values
