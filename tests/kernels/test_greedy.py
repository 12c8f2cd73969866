"""Masked greedy verification: Triton kernel == torch reference == Python oracle."""

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
    oracle_greedy,
    pack_bitmask,
    random_batch,
)

from structspec.kernels.greedy import verify_greedy_torch, verify_greedy_triton


def run_both(batch: Batch, block_v: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Run both backends (on DEVICE), check they agree exactly and left the inputs alone."""
    args = on_device(batch.args)
    before = [t.clone() for t in args]
    expected = verify_greedy_torch(*args)
    got = verify_greedy_triton(*args, block_v=block_v)
    assert_unchanged(before, args)
    assert got[0].dtype == torch.int32 and got[1].dtype == torch.int32
    assert torch.equal(got[0], expected[0]), f"tokens differ:\n{got[0]}\nvs reference\n{expected[0]}"
    assert torch.equal(got[1], expected[1]), f"counts differ: {got[1]} vs {expected[1]}"
    return expected[0].cpu(), expected[1].cpu()


def make_batch(lengths: list[int], logits: torch.Tensor, allowed: torch.Tensor, drafts: list[int]) -> Batch:
    """A hand-built batch; ``allowed`` is packed into the bitmask."""
    drafts_t = torch.tensor(drafts, dtype=torch.int64)
    return Batch(lengths, logits, allowed, pack_bitmask(allowed), drafts_t, cu_from_lengths(lengths))


@pytest.mark.parametrize("seed", range(6))
def test_random_batches_match_reference(seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, 6, (5,), generator=gen).tolist()
    vocab = [37, 100, 1000][seed % 3]
    dtype = LOGIT_DTYPES[seed % 3]
    batch = random_batch(gen, lengths, vocab, dtype=dtype, token_dtype=[torch.int64, torch.int32][seed % 2])
    out, acc = run_both(batch)
    assert out.shape == (5, max(lengths) + 1)
    # Padding after the valid prefix is -1, and valid entries are real tokens.
    for row, k in zip(out.tolist(), acc.tolist()):
        assert all(t >= 0 for t in row[: k + 1]) and all(t == -1 for t in row[k + 1 :])


@pytest.mark.parametrize("block_v", [32, 64, 256])
def test_multi_tile_with_ties_across_tiles(block_v: int) -> None:
    # Integer logits in [0, 3) tie constantly; small tiles put equal maxima in
    # different tiles, so the cross-tile rule (keep the earlier) is exercised.
    gen = torch.Generator().manual_seed(block_v)
    batch = random_batch(gen, [4, 0, 2, 7], 1000, logit_levels=3, density=0.7)
    run_both(batch, block_v=block_v)


def test_ties_pick_lowest_token_id() -> None:
    vocab = 300
    logits = torch.zeros(2, vocab)
    logits[:, [5, 77, 260]] = 4.0  # three equal maxima, in different 64-token tiles
    allowed = torch.ones(2, vocab, dtype=torch.bool)
    allowed[1, 5] = False  # second row: lowest allowed maximum is 77
    batch = make_batch([1], logits, allowed, [5])
    out, acc = run_both(batch, block_v=64)
    assert out.tolist() == [[5, 77]] and acc.tolist() == [1]


def test_all_masked_but_one_and_fully_masked_rows() -> None:
    vocab = 77
    logits = torch.randn(4, vocab, generator=torch.Generator().manual_seed(0))
    allowed = torch.zeros(4, vocab, dtype=torch.bool)
    allowed[0, 70] = True  # only token 70, although it is not the raw argmax
    allowed[1, 3] = True
    allowed[2, 40] = True
    # row 3 (bonus) allows nothing -> -1
    batch = make_batch([3], logits, allowed, [70, 3, 40])
    out, acc = run_both(batch, block_v=32)
    assert out.tolist() == [[70, 3, 40, -1]] and acc.tolist() == [3]


def test_masked_out_draft_is_never_accepted() -> None:
    vocab = 64
    logits = torch.zeros(2, vocab)
    logits[0, 9] = 10.0  # raw argmax, but masked out below
    logits[0, 20] = 5.0
    allowed = torch.ones(2, vocab, dtype=torch.bool)
    allowed[0, 9] = False
    batch = make_batch([1], logits, allowed, [9])
    out, acc = run_both(batch)
    assert out.tolist() == [[20, -1]] and acc.tolist() == [0]


def test_full_accept_reject_at_zero_and_empty_drafts() -> None:
    gen = torch.Generator().manual_seed(3)
    lengths = [4, 0, 3, 0]
    batch = random_batch(gen, lengths, 50, draft_from_target=1.0)
    # Sequence 2 rejects at position 0: replace its first draft (packed row
    # cu[2] + 2 = 6) by a non-target.
    target0 = int(batch.logits[6].float().masked_fill(~batch.allowed[6], float("-inf")).argmax())
    batch.draft_tokens[4] = (target0 + 1) % 50
    out, acc = run_both(batch)
    assert acc.tolist() == [4, 0, 0, 0]
    assert out[1, 0] >= 0 and out[3, 0] >= 0  # empty drafts still emit the bonus token
    assert out[2, 0] == target0 and (out[2, 1:] == -1).all()


def test_batch_of_only_empty_drafts() -> None:
    gen = torch.Generator().manual_seed(4)
    batch = random_batch(gen, [0, 0, 0], 33)
    out, acc = run_both(batch)
    assert out.shape == (3, 1) and acc.tolist() == [0, 0, 0]


def test_empty_batch() -> None:
    out, acc = run_both(make_batch([], torch.empty(0, 10), torch.empty(0, 10, dtype=torch.bool), []))
    assert out.shape == (0, 1) and acc.shape == (0,)


def test_nan_and_neg_inf_logits_count_as_masked() -> None:
    vocab = 40
    logits = torch.zeros(3, vocab)
    logits[0, 2] = float("nan")
    logits[0, 30] = 1.0
    logits[1, :] = float("-inf")  # allowed everywhere but nothing usable
    allowed = torch.ones(3, vocab, dtype=torch.bool)
    batch = make_batch([2], logits, allowed, [30, 0])
    out, acc = run_both(batch, block_v=32)
    assert out.tolist() == [[30, -1, -1]] and acc.tolist() == [1]


@pytest.mark.parametrize("vocab", [49152, 50257, 151665])
def test_large_vocab(vocab: int) -> None:
    gen = torch.Generator().manual_seed(vocab)
    # Two rows only: the interpreter pays per tile in Python.
    batch = random_batch(gen, [1], vocab, dtype=torch.bfloat16, density=0.3, draft_from_target=1.0)
    # Put the winning logit in the ragged last tile.
    batch.logits[1, vocab - 1] = 100.0
    batch.allowed[1, vocab - 1] = True
    batch.bitmask = pack_bitmask(batch.allowed)
    out, acc = run_both(batch)
    assert acc.tolist() == [1] and out[0, 1] == vocab - 1


def test_bits_past_vocab_are_ignored() -> None:
    vocab = 40  # 2 words; bits 40..63 of the mask are padding
    logits = torch.zeros(1, vocab)
    logits[0, 0] = -5.0
    batch = make_batch([0], logits, torch.zeros(1, vocab, dtype=torch.bool), [])
    # Token 0 allowed; tokens 32..39 disallowed but every padding bit set.
    batch.bitmask = torch.tensor([[1, -1 & ~0xFF]], dtype=torch.int32)
    out, _ = run_both(batch, block_v=64)
    assert out.tolist() == [[0]]


def test_strided_logits_rows() -> None:
    gen = torch.Generator().manual_seed(8)
    batch = random_batch(gen, [2, 1], 90)
    wide = torch.full((batch.logits.shape[0], 128), 99.0)  # padding columns would win if read
    wide[:, :90] = batch.logits
    batch.logits = wide[:, :90]
    assert batch.logits.stride() == (128, 1)
    run_both(batch, block_v=32)


@pytest.mark.parametrize("seed", range(4))
def test_reference_matches_python_oracle(seed: int) -> None:
    gen = torch.Generator().manual_seed(100 + seed)
    lengths = torch.randint(0, 5, (4,), generator=gen).tolist()
    batch = random_batch(gen, lengths, 23, logit_levels=4 if seed % 2 else None, density=0.4)
    got = as_lists(*verify_greedy_torch(*batch.args))
    assert got == oracle_greedy(batch)
