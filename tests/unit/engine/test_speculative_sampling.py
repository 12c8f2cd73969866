"""Invariant 3: with temperature > 0, speculative sampling keeps the target distribution."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from scipy.stats import chi2_contingency

from structspec.engine.engine import ExtractOptions
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


def sample(engine, n, seed0, temperature, proposer=None, strategy="none"):
    counts = Counter()
    for seed in range(seed0, seed0 + n):
        res = engine.extract(SCHEMA, TEXT, ExtractOptions(strategy=strategy, draft_len=4, temperature=temperature,
                                                          seed=seed, max_tokens=32), proposer=proposer)
        assert res.status == "succeeded", res.error
        counts[(res.value["colour"], res.value["size"])] += 1
    return counts


def same_distribution_p(a: Counter, b: Counter) -> float:
    keys = sorted(set(a) | set(b))
    table = [[a[k] for k in keys], [b[k] for k in keys]]
    return chi2_contingency(table)[1]


N = 200


@pytest.fixture(scope="module")
def plain(tiny_engine):
    counts = sample(tiny_engine, N, 0, temperature=2.0)
    assert len(counts) >= 4, f"distribution too concentrated to test: {counts}"
    return counts


def test_speculative_sampling_keeps_target_distribution(tiny_engine, plain):
    spec = sample(tiny_engine, N, 10_000, temperature=2.0, proposer=FirstAllowedProposer())
    composite = sample(tiny_engine, N, 20_000, temperature=2.0, strategy="composite")
    assert same_distribution_p(plain, spec) > 1e-3, (plain, spec)
    assert same_distribution_p(plain, composite) > 1e-3, (plain, composite)


def test_the_distribution_test_detects_a_different_distribution(tiny_engine, plain):
    # Power check: the same test at the same sample size must tell temperature 2 from 0.5.
    cooler = sample(tiny_engine, N, 30_000, temperature=0.5, proposer=FirstAllowedProposer())
    assert same_distribution_p(plain, cooler) < 1e-3, (plain, cooler)


def test_seed_makes_sampling_reproducible(tiny_engine):
    opts = dict(strategy="composite", draft_len=4, temperature=1.5, max_tokens=32)
    a = tiny_engine.extract(SCHEMA, TEXT, ExtractOptions(seed=7, **opts))
    b = tiny_engine.extract(SCHEMA, TEXT, ExtractOptions(seed=7, **opts))
    assert a.tokens == b.tokens
