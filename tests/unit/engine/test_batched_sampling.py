"""Invariant 3 in a batch: sampled outputs follow the model's masked, temperature-scaled
distribution exactly, whatever drafts them and whatever else is in the batch.

The target is computed here, independently of the engine: every token-level outcome of a
small grammar (an object with two enums) with its probability, from plain forward passes of
the model one sequence at a time and the grammar's bitmask. Then N = 2000 samples are drawn
through the batched engine (64 sequences at once, greedy requests mixed in, a deliberately
wrong proposer among the strategies) and tested for goodness of fit.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from scipy.stats import chisquare

from structspec import kernels
from structspec.kernels.bitmask import unpack_bitmask
from structspec.engine.engine import Engine, Request
from structspec.engine.prompt import build_prompt
from structspec.options import RequestOptions
from tests.unit.engine.test_speculative_sampling import SCHEMA, TEXT, FirstAllowedProposer

# `make test-long` (docs/testing.md): 2000 samples twice, ~15% of a full run; `make test` keeps the
# sampling checks of tests/kernels/test_sampling_stats.py and test_speculative_sampling.py
pytestmark = pytest.mark.long

TEMPERATURE = 2.0
# strategy -> (samples, draft_len); "first-allowed" is FirstAllowedProposer: deterministic and
# often wrong at the free choices, where its drafts are accepted with probability p(x) < 1
GROUPS = {"first-allowed": (800, 3), "composite": (400, 4), "schema": (200, 2), "ngram": (200, 4), "none": (400, 0)}
N = sum(n for n, _ in GROUPS.values())
GREEDY_PER_RUN = 8  # temperature-0 requests in every run: greedy and sampled rows share the steps
RUN = 250  # sampled requests per engine.run
MIN_EXPECTED = 5  # chi-square cells with fewer expected samples are merged
ALPHA = 1e-3
EOS = "<eos>"
# compact JSON: the exact target walks every output the grammar allows, which whitespace gaps
# would make astronomically many
WHITESPACE = "compact"


def exact_distribution(loaded, grammar, prompt: list[int], temperature: float) -> dict[tuple, float]:
    """Every complete output (token ids, then EOS if the model chose it) with its probability
    under softmax(masked logits / temperature), by walking the grammar's token tree."""
    vocab = loaded.vocab_size
    eos = loaded.eos_token_ids
    bitmask = torch.zeros((1, (vocab + 31) // 32), dtype=torch.int32)
    outcomes: dict[tuple, float] = {}
    stack: list[tuple[tuple, float]] = [((), 1.0)]
    while stack:
        prefix, p = stack.pop()
        matcher = grammar.matcher()
        assert matcher.consume(list(prefix))
        if matcher.is_stopped():
            outcomes[prefix] = p
            continue
        with torch.inference_mode():
            logits = loaded.model(input_ids=torch.tensor([prompt + list(prefix)]), logits_to_keep=1).logits[0, -1]
        matcher.fill_bitmask(bitmask, 0)
        allowed = unpack_bitmask(bitmask, vocab)[0]
        probs = torch.softmax(logits.float().masked_fill(~allowed, float("-inf")) / temperature, dim=-1)
        for token in allowed.nonzero().flatten().tolist():
            q = p * float(probs[token])
            if token in eos:
                assert matcher.is_accepting()
                outcomes[prefix + (EOS,)] = q
            elif q > 0:
                stack.append((prefix + (token,), q))
    return outcomes


def outcome(result, grammar) -> tuple:
    """The result as a key of exact_distribution. EOS is part of it only where the grammar
    had not ended: a speculative step that drafts the closing brace ends on the (forced) EOS
    bonus token, stop_reason "eos", with the same output as a step that emits the brace."""
    matcher = grammar.matcher()
    assert matcher.consume(result.tokens)
    chose_eos = result.stats.stop_reason == "eos" and not matcher.is_stopped()
    return tuple(result.tokens) + ((EOS,) if chose_eos else ())


def goodness_of_fit(counts: Counter, target: dict[tuple, float]) -> tuple[float, str]:
    """Chi-square p-value of `counts` against `target`. Outcomes are cells, rarest first merged
    until every cell expects at least MIN_EXPECTED samples; an outcome outside `target` fails."""
    unknown = set(counts) - set(target)
    assert not unknown, f"outcomes the grammar and model cannot produce: {sorted(unknown)[:3]}"
    n = sum(counts.values())
    cells: list[tuple[float, int]] = []
    pending_p, pending_n = 0.0, 0
    for key in sorted(target, key=target.get):
        pending_p += target[key]
        pending_n += counts[key]
        if pending_p * n >= MIN_EXPECTED:
            cells.append((pending_p, pending_n))
            pending_p, pending_n = 0.0, 0
    if pending_p > 0:  # a remainder too small for a cell of its own joins the last one
        last_p, last_n = cells.pop()
        cells.append((last_p + pending_p, last_n + pending_n))
    total = sum(p for p, _ in cells)  # 1 up to float rounding, which chisquare would refuse
    expected = [p / total * n for p, _ in cells]
    observed = [c for _, c in cells]
    result = chisquare(observed, expected)
    summary = f"chi2 {result.statistic:.1f}, {len(cells)} cells, {n} samples, p {result.pvalue:.3g}"
    return float(result.pvalue), summary


def requests_for(strategy: str, count: int, draft_len: int, seed0: int) -> list[Request]:
    proposer = strategy == "first-allowed"
    out = []
    for i in range(count):
        opts = RequestOptions(strategy="none" if proposer else strategy, draft_len=draft_len,
                              temperature=TEMPERATURE, seed=seed0 + i, max_tokens=32)
        # half the composite requests draft batch-aware (fewer tokens when the batch is large)
        acceptance = (0.8, 0.5) if strategy == "composite" and i % 2 else None
        out.append(Request(SCHEMA, TEXT, opts, proposer=FirstAllowedProposer() if proposer else None,
                           acceptance=acceptance))
    return out


def draw(loaded, greedy_tokens: list[int], seed0: int, fraction: float = 1.0) -> dict[str, list]:
    """N * fraction sampled results by group, through one batched engine in runs of RUN
    requests, each run with greedy requests mixed in (whose outputs must equal `greedy_tokens`)."""
    engine = Engine(loaded, kernel_backend="torch", engine_max_seqs=64, json_whitespace=WHITESPACE)
    tagged = []
    for g, (strategy, (count, draft_len)) in enumerate(GROUPS.items()):
        tagged += [(strategy, r) for r in requests_for(strategy, round(count * fraction), draft_len,
                                                       seed0 + 100_000 * g)]
    tagged = tagged[::2] + tagged[1::2]  # every run holds several strategies
    results: dict[str, list] = {s: [] for s in GROUPS}
    for start in range(0, len(tagged), RUN):
        chunk = tagged[start:start + RUN]
        greedy = [Request(SCHEMA, TEXT, RequestOptions(strategy="composite", draft_len=4, max_tokens=32))
                  for _ in range(GREEDY_PER_RUN)]
        batch = [r for _, r in chunk]
        batch = batch[:len(batch) // 2] + greedy + batch[len(batch) // 2:]
        done = dict(zip((r.id for r in batch), engine.run(batch)))
        for r in greedy:
            assert done[r.id].tokens == greedy_tokens, "a greedy request beside sampled ones changed its output"
        for strategy, r in chunk:
            res = done[r.id]
            assert res.status == "succeeded", res.error
            results[strategy].append(res)
    return results


@pytest.fixture(scope="module")
def grammar(tiny_compact_engine):
    assert tiny_compact_engine.settings.json_whitespace == WHITESPACE
    return tiny_compact_engine.grammars.get_for(SCHEMA, TEXT, False)


@pytest.fixture(scope="module")
def target(tiny_loaded, grammar):
    prompt = build_prompt(tiny_loaded.tokenizer, SCHEMA, TEXT, tiny_loaded.context_len)
    return exact_distribution(tiny_loaded, grammar, prompt, TEMPERATURE)


@pytest.fixture(scope="module")
def greedy_tokens(tiny_loaded):
    serial = Engine(tiny_loaded, kernel_backend="torch", engine_max_seqs=1, json_whitespace=WHITESPACE)
    return serial.extract(SCHEMA, TEXT, RequestOptions(strategy="none", max_tokens=32)).tokens


def test_the_exact_target_is_a_whole_distribution(target):
    assert abs(sum(target.values()) - 1) < 1e-5
    # several outcomes with real mass: a test that could tell a wrong sampler from a right one
    assert sum(p > 0.05 for p in target.values()) >= 5, sorted(target.values())[-10:]


def test_batched_sampling_follows_the_exact_target_distribution(tiny_loaded, grammar, target, greedy_tokens):
    results = draw(tiny_loaded, greedy_tokens, seed0=1)
    pooled = Counter(outcome(r, grammar) for group in results.values() for r in group)
    p_all, fit_all = goodness_of_fit(pooled, target)
    first = results["first-allowed"]
    p_first, fit_first = goodness_of_fit(Counter(outcome(r, grammar) for r in first), target)
    proposed = sum(r.stats.proposed for r in first)
    accepted = sum(r.stats.accepted for r in first)
    print(f"\nall {N}: {fit_all}; first-allowed alone: {fit_first}; its drafts accepted {accepted}/{proposed}")
    # the wrong proposer's drafts were genuinely tested: many accepted, many rejected (most of
    # its drafts are forced structure, accepted with p = 1; the rejections are the free choices)
    assert accepted > 1000 and proposed - accepted > 200, (accepted, proposed)
    assert p_all > ALPHA, fit_all
    assert p_first > ALPHA, fit_first


def test_the_fit_test_fails_a_biased_acceptance_test(tiny_loaded, grammar, target, greedy_tokens, monkeypatch):
    """Power check: verification that accepts a draft with probability min(1, 2 p/q) instead of
    min(1, p/q) (its uniforms halved) must fail the same test, here with half the samples (N/2):
    a sampler the test rejects at N/2 it rejects at N with at least that confidence."""
    real = kernels.make_sampling_randoms

    def biased(*args, **kwargs):
        accept_u, noise = real(*args, **kwargs)
        return accept_u * 0.5, noise

    monkeypatch.setattr(kernels, "make_sampling_randoms", biased)
    results = draw(tiny_loaded, greedy_tokens, seed0=1, fraction=0.5)
    pooled = Counter(outcome(r, grammar) for group in results.values() for r in group)
    p_all, fit_all = goodness_of_fit(pooled, target)
    print(f"\nbiased acceptance test: {fit_all}")
    assert p_all < ALPHA, fit_all
