"""Apply a packed token allow-mask to logits in place (non-speculative path).

Bitmask format (llguidance / xgrammar): ``bitmask[row, t // 32]`` is an int32
word whose bit ``t % 32`` is set when token ``t`` is allowed.  Bits at or past
the vocabulary size are ignored.
"""

from __future__ import annotations

import torch

from structspec.kernels._triton import interpreter_enabled, next_power_of_2, require_triton, tl, triton
from structspec.kernels._validate import (
    LOGIT_DTYPES,
    check_bitmask,
    check_block_v,
    check_dtype,
    check_ndim,
    check_same_device,
    check_tensor,
    check_unit_column_stride,
)

__all__ = ["apply_bitmask_inplace_torch", "apply_bitmask_inplace_triton", "unpack_bitmask"]


@triton.jit
def _apply_bitmask_kernel(
    logits_ptr,  # [num_rows, V] fp32/bf16/fp16, unit column stride; modified in place
    bitmask_ptr,  # [num_rows, ceil(V / 32)] int32, unit column stride
    vocab_size,
    logits_stride_row,
    bitmask_stride_row,
    BLOCK_V: tl.constexpr,  # a power of two >= 32 so tiles cover whole bitmask words
):
    row = tl.program_id(0).to(tl.int64)
    v0 = tl.program_id(1) * BLOCK_V
    lanes = tl.arange(0, BLOCK_V)
    in_vocab = lanes < vocab_size - v0
    # Each lane reads the word holding its own bit; the 32 lanes sharing a word
    # hit the same cache line, so traffic is one word per 32 tokens.
    words = tl.load(bitmask_ptr + row * bitmask_stride_row + v0 // 32 + lanes // 32, mask=in_vocab, other=0)
    allowed = ((words >> (lanes % 32)) & 1) != 0
    # Only disallowed lanes are written: allowed logits are never touched
    # (nor re-rounded), and nothing is read from the logits at all.
    neg_inf = tl.full([BLOCK_V], float("-inf"), dtype=logits_ptr.dtype.element_ty)
    tl.store(logits_ptr + row * logits_stride_row + v0 + lanes, neg_inf, mask=in_vocab & ~allowed)


def _check_apply_args(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    check_tensor("logits", logits)
    check_dtype("logits", logits, LOGIT_DTYPES)
    check_ndim("logits", logits, 2, "[num_rows, V]")
    if logits.shape[1] < 1:
        raise ValueError("logits must have at least one vocabulary column")
    check_unit_column_stride("logits", logits)
    check_bitmask(bitmask, logits.shape[0], logits.shape[1], "one row per logits row")
    check_same_device("logits", logits, bitmask=bitmask)


def apply_bitmask_inplace_triton(logits: torch.Tensor, bitmask: torch.Tensor, *, block_v: int | None = None) -> None:
    """Set ``logits[r, t] = -inf`` wherever bit ``t`` of row ``r`` of ``bitmask`` is clear.

    ``logits``: [N, V] float32/bfloat16/float16 with any row stride and unit
    column stride, modified in place; allowed entries are left bit-for-bit
    unchanged.  ``bitmask``: int32 [N, ceil(V / 32)].  ``block_v`` (power of
    two >= 32) overrides the vocab tile size, for tests.
    """
    _check_apply_args(logits, bitmask)
    require_triton()
    num_rows, vocab_size = logits.shape
    if num_rows == 0:
        return
    if block_v is None:
        block_v = max(32, min(next_power_of_2(vocab_size), 32768 if interpreter_enabled() else 1024))
    check_block_v(block_v)
    grid = (num_rows, triton.cdiv(vocab_size, block_v))
    _apply_bitmask_kernel[grid](
        logits_ptr=logits,
        bitmask_ptr=bitmask,
        vocab_size=vocab_size,
        logits_stride_row=logits.stride(0),
        bitmask_stride_row=bitmask.stride(0),
        BLOCK_V=block_v,
        num_warps=4,
    )


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Expand an int32 [N, W] packed allow-mask to bool [N, vocab_size] (True = allowed)."""
    shifts = torch.arange(32, device=bitmask.device, dtype=torch.int32)
    # Arithmetic right shift keeps the sign bit, but `& 1` only looks at bit 0.
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1
    return bits.reshape(bitmask.shape[0], -1)[:, :vocab_size].bool()


def apply_bitmask_inplace_torch(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Reference for :func:`apply_bitmask_inplace_triton` (same contract)."""
    _check_apply_args(logits, bitmask)
    allowed = unpack_bitmask(bitmask, logits.shape[1])
    logits.masked_fill_(~allowed, float("-inf"))
