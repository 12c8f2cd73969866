"""In-place bitmask application and bitmask unpacking."""

from __future__ import annotations

import pytest
import torch
from kernel_cases import DEVICE, LOGIT_DTYPES, pack_bitmask

from structspec.kernels.bitmask import apply_bitmask_inplace_torch, apply_bitmask_inplace_triton, unpack_bitmask


def test_unpack_matches_python_loop() -> None:
    gen = torch.Generator().manual_seed(0)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (3, 2), generator=gen, dtype=torch.int32)
    vocab = 45
    expected = [[bool((int(bitmask[r, t // 32]) >> (t % 32)) & 1) for t in range(vocab)] for r in range(3)]
    assert unpack_bitmask(bitmask, vocab).tolist() == expected


def test_pack_round_trip() -> None:
    allowed = torch.rand(4, 100, generator=torch.Generator().manual_seed(1)) < 0.5
    allowed[:, 31] = True  # the sign bit of word 0
    assert torch.equal(unpack_bitmask(pack_bitmask(allowed), 100), allowed)


CASES = [(vocab, block_v, dtype) for vocab, block_v in [(37, None), (1000, None), (1000, 64)] for dtype in LOGIT_DTYPES]
# Large vocabularies cost interpreter time; one dtype each is enough there.
CASES += [(49152, None, torch.float32), (50257, None, torch.bfloat16), (151665, None, torch.float16)]


@pytest.mark.parametrize(("vocab", "block_v", "dtype"), CASES)
def test_triton_matches_torch(vocab: int, block_v: int | None, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(vocab)
    rows = 3 if vocab < 10000 else 1
    logits = (torch.randn(rows, vocab, generator=gen) * 4).to(dtype)
    allowed = torch.rand(rows, vocab, generator=gen) < 0.3
    bitmask = pack_bitmask(allowed)
    if vocab % 32:
        bitmask[:, -1] |= -(2**31)  # a padding bit past the vocab must be ignored
    expected = logits.clone()
    apply_bitmask_inplace_torch(expected, bitmask)
    got = logits.clone().to(DEVICE)
    mask_before = bitmask.clone()
    apply_bitmask_inplace_triton(got, bitmask.to(DEVICE), block_v=block_v)
    got = got.cpu()
    assert torch.equal(got, expected)
    assert torch.equal(bitmask, mask_before)
    assert torch.equal(got[allowed], logits[allowed])  # allowed logits untouched, bit for bit
    assert (got[~allowed] == float("-inf")).all()


def test_strided_rows_do_not_touch_padding_columns() -> None:
    buffer = torch.zeros(4, 64, device=DEVICE)
    logits = buffer[:, :40]  # row stride 64, vocab 40
    bitmask = torch.zeros(4, 2, dtype=torch.int32, device=DEVICE)  # nothing allowed
    apply_bitmask_inplace_triton(logits, bitmask, block_v=32)
    assert (buffer[:, :40] == float("-inf")).all()
    assert (buffer[:, 40:] == 0).all()


def test_empty_rows_is_a_no_op(monkeypatch) -> None:
    """Zero rows launch nothing (a grid of zero programs is an error on some backends) and
    return; rows with a wrong bitmask width are still refused."""
    import structspec.kernels.bitmask as bitmask_module

    class NoLaunch:
        def __getitem__(self, grid):
            raise AssertionError(f"a kernel was launched for zero rows (grid {grid})")

    monkeypatch.setattr(bitmask_module, "_apply_bitmask_kernel", NoLaunch())
    logits = torch.empty(0, 10, device=DEVICE)
    assert apply_bitmask_inplace_triton(logits, torch.empty(0, 1, dtype=torch.int32, device=DEVICE)) is None
    assert logits.shape == (0, 10)
    with pytest.raises(ValueError):
        apply_bitmask_inplace_triton(logits, torch.empty(0, 3, dtype=torch.int32, device=DEVICE))
