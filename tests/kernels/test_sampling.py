"""Masked speculative sampling: Triton kernel == torch reference == Python oracle."""

from __future__ import annotations

import pytest
import torch
from kernel_cases import (
    LOGIT_DTYPES,
    Batch,
    as_lists,
    assert_unchanged,
    cu_from_lengths,
    on_device,
    oracle_sampling,
    pack_bitmask,
    random_batch,
)

from structspec.kernels.sampling import make_sampling_randoms, verify_sampling_torch, verify_sampling_triton


def randoms(batch: Batch, seed: int, with_draft_probs: bool, sharp: float = 1.0):
    """(temperature, accept_uniform, sample_noise, draft_probs) for a batch."""
    gen = torch.Generator().manual_seed(seed)
    num_seqs = len(batch.lengths)
    vocab = batch.logits.shape[1]
    temperature = 0.5 + torch.rand(num_seqs, generator=gen) * 1.5
    accept_uniform, sample_noise = make_sampling_randoms(
        batch.cu_num_draft, vocab, [torch.Generator().manual_seed(seed * 1000 + b) for b in range(num_seqs)], "cpu"
    )
    draft_probs = None
    if with_draft_probs:
        q = torch.softmax(torch.randn(batch.draft_tokens.numel(), vocab, generator=gen) * sharp, dim=-1)
        # Make q consistent with the drafts: the draft token gets real mass.
        q[torch.arange(q.shape[0]), batch.draft_tokens.long()] += 0.5
        draft_probs = q / q.sum(-1, keepdim=True)
    return temperature, accept_uniform, sample_noise, draft_probs


def run_both(batch: Batch, rnd, block_v: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Run both backends, check exact agreement and that no input was modified."""
    args, rnd = on_device(batch.args), on_device(rnd)  # DEVICE: kernel_cases.py
    inputs = [*args, *(t for t in rnd if t is not None)]
    before = [t.clone() for t in inputs]
    expected = verify_sampling_torch(*args, *rnd)
    got = verify_sampling_triton(*args, *rnd, block_v=block_v)
    assert_unchanged(before, inputs)
    assert got[0].dtype == torch.int32 and got[1].dtype == torch.int32
    assert torch.equal(got[0], expected[0]), f"tokens differ:\n{got[0]}\nvs reference\n{expected[0]}"
    assert torch.equal(got[1], expected[1]), f"counts differ: {got[1]} vs {expected[1]}"
    return expected[0].cpu(), expected[1].cpu()


def set_allowed(batch: Batch, allowed: torch.Tensor) -> None:
    batch.allowed = allowed
    batch.bitmask = pack_bitmask(allowed)


@pytest.mark.parametrize("with_draft_probs", [False, True], ids=["onehot", "draft_probs"])
@pytest.mark.parametrize("seed", range(5))
def test_random_batches_match_reference(seed: int, with_draft_probs: bool) -> None:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, 6, (4,), generator=gen).tolist()
    vocab = [37, 100, 1000, 64, 333][seed]
    dtype = LOGIT_DTYPES[seed % 3]
    batch = random_batch(
        gen,
        lengths,
        vocab,
        dtype=dtype,
        token_dtype=[torch.int64, torch.int32][seed % 2],
        logit_levels=3 if seed in (1, 3) else None,  # many tied probabilities
    )
    out, acc = run_both(batch, randoms(batch, seed, with_draft_probs))
    for row, k in zip(out.tolist(), acc.tolist()):
        assert all(t >= 0 for t in row[: k + 1]) and all(t == -1 for t in row[k + 1 :])


@pytest.mark.parametrize("with_draft_probs", [False, True], ids=["onehot", "draft_probs"])
def test_multi_tile_rows(with_draft_probs: bool) -> None:
    # 1000 tokens in 32-token tiles: the online softmax rescales across tiles
    # and the race compares maxima across tiles.
    gen = torch.Generator().manual_seed(11)
    batch = random_batch(gen, [3, 0, 5], 1000, density=0.8)
    run_both(batch, randoms(batch, 11, with_draft_probs), block_v=32)


def test_race_ties_pick_lowest_token_id() -> None:
    # Equal noise turns the race into an argmax of the weights; the tied
    # maxima 10, 40, 90 sit in different 32-token tiles.
    vocab = 100
    lengths = [0, 1]
    logits = torch.zeros(3, vocab)
    logits[:, [10, 40, 90]] = 5.0
    allowed = torch.ones(3, vocab, dtype=torch.bool)
    batch = Batch(lengths, logits, allowed, pack_bitmask(allowed), torch.tensor([10]), cu_from_lengths(lengths))
    # u = 1 rejects draft 10 (p(10) < 1/3); the residual excludes 10.
    rnd = (torch.ones(2), torch.ones(1), torch.ones(2, vocab), None)
    out, acc = run_both(batch, rnd, block_v=32)
    assert out.tolist() == [[10, -1], [40, -1]] and acc.tolist() == [0, 0]


def test_high_acceptance_and_reject_at_zero() -> None:
    # Peaked targets whose argmax is the draft: drafts are accepted with high
    # probability, except sequence 1 whose first draft is masked out.
    vocab = 50
    gen = torch.Generator().manual_seed(5)
    lengths = [4, 3, 0]
    batch = random_batch(gen, lengths, vocab, draft_from_target=1.0)
    batch.logits = batch.logits * 0.0
    rows = [0, 1, 2, 3, 5, 6, 7]  # the draft rows
    batch.logits[rows, batch.draft_tokens] = 30.0
    allowed = batch.allowed.clone()
    allowed[rows, batch.draft_tokens] = True
    allowed[5, batch.draft_tokens[4]] = False  # sequence 1, position 0
    set_allowed(batch, allowed)
    out, acc = run_both(batch, randoms(batch, 5, with_draft_probs=False))
    assert acc.tolist() == [4, 0, 0]
    assert out[1, 0] != batch.draft_tokens[4]


@pytest.mark.parametrize("with_draft_probs", [False, True], ids=["onehot", "draft_probs"])
def test_masked_out_draft_never_accepted(with_draft_probs: bool) -> None:
    vocab = 20
    num_seqs = 64
    lengths = [1] * num_seqs
    gen = torch.Generator().manual_seed(2)
    batch = random_batch(gen, lengths, vocab, draft_from_target=0.0)
    allowed = torch.ones(2 * num_seqs, vocab, dtype=torch.bool)
    allowed[0::2, 7] = False  # every draft row forbids token 7 ...
    batch.draft_tokens[:] = 7  # ... which is every draft
    batch.logits[:, 7] = 50.0  # and which the raw logits love
    set_allowed(batch, allowed)
    rnd = list(randoms(batch, 2, with_draft_probs))
    rnd[1] = torch.full_like(rnd[1], torch.finfo(torch.float32).tiny)  # smallest possible uniform
    if with_draft_probs:
        rnd[3][:, 7] = 0.0  # even q(x) == 0 must not make p/q "infinite"
    out, acc = run_both(batch, tuple(rnd))
    assert acc.sum() == 0 and not (out[:, 0] == 7).any()


def test_zero_residual_falls_back_to_p() -> None:
    """With q == p the residual max(p - q, 0) is all zero.  For consistent
    inputs that implies acceptance (p(x)/q(x) = 1), so the fallback needs a
    draft the grammar forbids (p(x) = 0) that q also gives no mass: here each
    draft row allows only token a, so p = onehot(a) exactly, and q = onehot(a)."""
    vocab = 40
    lengths = [1, 2, 1]
    gen = torch.Generator().manual_seed(9)
    batch = random_batch(gen, lengths, vocab, density=1.0)
    draft_rows = [0, 2, 3, 5]
    only = torch.tensor([3, 17, 39, 0])  # the single allowed token of each draft row
    allowed = batch.allowed.clone()
    allowed[draft_rows] = False
    allowed[draft_rows, only] = True
    set_allowed(batch, allowed)
    batch.draft_tokens[:] = (only + 1) % vocab  # always a forbidden token
    temperature, accept_uniform, sample_noise, _ = randoms(batch, 9, with_draft_probs=False)
    draft_probs = torch.zeros(4, vocab)
    draft_probs[torch.arange(4), only] = 1.0
    out, acc = run_both(batch, (temperature, accept_uniform, sample_noise, draft_probs))
    assert acc.tolist() == [0, 0, 0]
    assert out[:, 0].tolist() == [3, 17, 0]  # p's only token, not -1


def test_rows_without_allowed_tokens_emit_minus_one() -> None:
    vocab = 33
    gen = torch.Generator().manual_seed(4)
    batch = random_batch(gen, [2, 0], vocab)
    allowed = batch.allowed.clone()
    allowed[0] = False  # sequence 0, position 0: nothing allowed -> reject, draw -1
    allowed[3] = False  # sequence 1's bonus row
    set_allowed(batch, allowed)
    out, acc = run_both(batch, randoms(batch, 4, with_draft_probs=False))
    assert out[0, 0] == -1 and out[1, 0] == -1 and acc.tolist() == [0, 0]


@pytest.mark.parametrize("vocab", [49152, 151665])
@pytest.mark.parametrize("with_draft_probs", [False, True], ids=["onehot", "draft_probs"])
def test_large_vocab(vocab: int, with_draft_probs: bool) -> None:
    gen = torch.Generator().manual_seed(vocab)
    batch = random_batch(gen, [1], vocab, dtype=torch.bfloat16, density=0.3)
    run_both(batch, randoms(batch, 1, with_draft_probs, sharp=3.0))


@pytest.mark.parametrize("seed", range(6))
def test_reference_matches_python_oracle(seed: int) -> None:
    gen = torch.Generator().manual_seed(200 + seed)
    lengths = torch.randint(0, 5, (5,), generator=gen).tolist()
    batch = random_batch(gen, lengths, 19, density=0.5)
    rnd = randoms(batch, seed, with_draft_probs=bool(seed % 2))
    assert as_lists(*verify_sampling_torch(*batch.args, *rnd)) == oracle_sampling(batch, *rnd)


def test_make_sampling_randoms_ranges_and_reproducibility() -> None:
    cu = cu_from_lengths([3, 0, 2])
    gens = [torch.Generator().manual_seed(s) for s in (1, 2, 3)]
    u, noise = make_sampling_randoms(cu, 11, gens, "cpu")
    assert u.shape == (5,) and noise.shape == (3, 11)  # a noise row per sequence
    assert u.dtype == noise.dtype == torch.float32
    assert (u > 0).all() and (u <= 1).all() and (noise > 0).all()
    # A sequence's draws depend only on its own generator, not on its batch.
    u_alone, noise_alone = make_sampling_randoms(cu_from_lengths([2]), 11, [torch.Generator().manual_seed(3)], "cpu")
    assert torch.equal(u_alone, u[3:]) and torch.equal(noise_alone, noise[2:])
    with pytest.raises(ValueError, match="one generator per sequence"):
        make_sampling_randoms(cu, 11, gens[:2], "cpu")
    empty_u, empty_noise = make_sampling_randoms(cu_from_lengths([]), 11, [], "cpu")
    assert empty_u.shape == (0,) and empty_noise.shape == (0, 11)


def test_the_noise_is_exp1_and_its_smallest_draws_are_not_rounded() -> None:
    """make_sampling_randoms draws Exp(1) by inversion of float64 uniforms. A race is decided
    by the smallest draws: over 2**22 draws the ~64 below 2**-16 must all differ (inversion of
    float32 uniforms, spaced 2**-24, would put them in 256 values: collisions all but certain)."""
    from scipy.stats import kstest

    gens = [torch.Generator().manual_seed(5 + b) for b in range(64)]
    _, noise = make_sampling_randoms(cu_from_lengths([1] * 64), 1 << 16, gens, "cpu")
    draws = noise.flatten().double()
    assert draws.numel() == 1 << 22 and (draws > 0).all()
    fit = kstest(draws[:200_000].numpy(), "expon")
    assert fit.pvalue > 1e-3, fit
    small = draws[draws < 2.0 ** -16]
    assert 30 <= small.numel() <= 110, small.numel()  # 64 expected
    assert small.unique().numel() == small.numel(), small.sort().values
