"""Statistical checks of masked speculative sampling, for both backends.

Many one-draft sequences that share one target row are packed into a single
call, so every sequence contributes an independent draw of its first output
token.  Speculative sampling promises that draw is distributed exactly as the
masked target p, whatever the proposal; the acceptance rate is
sum_x min(p(x), q(x)) with explicit draft probabilities and E_x[p(x)] for a
deterministic proposer whose drafts happen to be distributed as q.
Seeds are fixed, so the outcome is deterministic.
"""

from __future__ import annotations

import math

import pytest
import torch
from kernel_cases import pack_bitmask
from scipy.stats import chisquare

from structspec.kernels.sampling import masked_probs_torch, verify_sampling_torch, verify_sampling_triton

VOCAB = 10
MASKED = [1, 4, 7]  # grammar-forbidden tokens
TEMPERATURE = 0.8
# The interpreter runs one Python program per sequence (~10 ms each), so the
# Triton backend gets fewer draws to keep the suite fast; the torch reference
# (whose outputs the Triton kernel matches exactly elsewhere) gets many.
DRAWS = {"torch": 20000, "triton": 400}


def _setup(num_seqs: int, with_draft_probs: bool, seed: int):
    gen = torch.Generator().manual_seed(seed)
    row = torch.randn(VOCAB, generator=gen) * 1.2
    allowed_row = torch.ones(VOCAB, dtype=torch.bool)
    allowed_row[MASKED] = False
    # The proposal differs from p and puts real mass on forbidden tokens.
    q = torch.softmax(torch.randn(VOCAB, generator=gen), dim=0)

    logits = row.repeat(2 * num_seqs, 1)
    bitmask = pack_bitmask(allowed_row.repeat(2 * num_seqs, 1))
    drafts = torch.multinomial(q, num_seqs, replacement=True, generator=gen)
    cu = torch.arange(num_seqs + 1, dtype=torch.int32)
    temperature = torch.full((num_seqs,), TEMPERATURE)
    accept_uniform = 1.0 - torch.rand(num_seqs, generator=gen)
    sample_noise = torch.empty(num_seqs, VOCAB).exponential_(generator=gen).clamp_(min=1e-30)
    draft_probs = q.repeat(num_seqs, 1) if with_draft_probs else None
    p = masked_probs_torch(row.unsqueeze(0), pack_bitmask(allowed_row.unsqueeze(0)), torch.tensor([TEMPERATURE]))[0]
    args = (logits, bitmask, drafts, cu, temperature, accept_uniform, sample_noise, draft_probs)
    return args, p.double(), q.double()


@pytest.mark.parametrize("with_draft_probs", [False, True], ids=["onehot", "draft_probs"])
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_first_token_follows_masked_target(backend: str, with_draft_probs: bool) -> None:
    num_seqs = DRAWS[backend]
    args, p, q = _setup(num_seqs, with_draft_probs, seed=1234 + with_draft_probs)
    verify = verify_sampling_triton if backend == "triton" else verify_sampling_torch
    out, num_accepted = verify(*args)

    first = out[:, 0].long()
    assert (first >= 0).all()
    # Forbidden tokens are never emitted, at any valid position.
    valid = torch.arange(out.shape[1]) <= num_accepted.unsqueeze(1)
    emitted = out[valid].long()
    assert not torch.isin(emitted, torch.tensor(MASKED)).any()

    counts = torch.bincount(first, minlength=VOCAB).double()
    allowed = p > 0
    expected_counts = p[allowed] / p[allowed].sum() * num_seqs  # renormalised in float64
    result = chisquare(counts[allowed].numpy(), expected_counts.numpy())
    assert result.pvalue > 1e-3, f"chi-square p-value {result.pvalue:.2e}: counts {counts.tolist()} vs p {p.tolist()}"

    # Acceptance rate of the first draft.
    expected = torch.minimum(p, q).sum() if with_draft_probs else (q * p).sum()
    rate = (num_accepted > 0).double().mean()
    sigma = math.sqrt(expected * (1 - expected) / num_seqs)
    assert abs(rate - expected) < 4 * sigma, f"acceptance {rate:.4f} vs expected {expected:.4f} (sigma {sigma:.4f})"
