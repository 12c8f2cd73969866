"""Grammar-masked greedy verification of speculative drafts.

For each sequence the target token at row ``j`` is the argmax of the logits
over the tokens the grammar allows at that row (ties go to the lowest token
id, like ``torch.argmax``).  Draft token ``j`` is accepted while it equals the
target; the first mismatch emits the target as the correction and stops; if
every draft token is accepted the bonus row's target is emitted.

A row "has a target" only if some allowed token has a logit that is not -inf
and not NaN: NaN logits are treated like disallowed tokens, and a row with no
such token yields -1 (which the engine treats as an error).  A masked-out
draft token can therefore never be accepted.
"""

from __future__ import annotations

import torch

from structspec.kernels._triton import interpreter_enabled, next_power_of_2, require_triton, tl, triton
from structspec.kernels._validate import RaggedBatch, check_block_v, check_ragged_batch, new_outputs
from structspec.kernels.bitmask import unpack_bitmask

__all__ = ["verify_greedy_torch", "verify_greedy_triton"]


@triton.jit(do_not_specialize=["out_stride"])
def _verify_greedy_kernel(
    logits_ptr,  # [num_draft + B, V] fp32/bf16/fp16, unit column stride
    bitmask_ptr,  # [num_draft + B, ceil(V / 32)] int32, unit column stride
    draft_tokens_ptr,  # [num_draft] int32/int64
    cu_num_draft_ptr,  # [B + 1] int32
    output_tokens_ptr,  # [B, out_stride] int32, pre-filled with -1
    num_accepted_ptr,  # [B] int32
    vocab_size,
    logits_stride_row,
    bitmask_stride_row,
    out_stride,  # max draft length + 1: changes every step, so not specialised
    BLOCK_V: tl.constexpr,  # vocab tile; a power of two >= 32 so tiles cover whole bitmask words
):
    seq = tl.program_id(0)
    draft_start = tl.load(cu_num_draft_ptr + seq)
    num_draft = tl.load(cu_num_draft_ptr + seq + 1) - draft_start
    # Sequence `seq` owns rows [draft_start + seq, draft_start + seq + num_draft].
    first_row = draft_start + seq
    # Tiles start at multiples of 32, so a lane's bit position and its word
    # within the tile never change; only the tile's base moves.
    lanes = tl.arange(0, BLOCK_V)
    lane_word = lanes // 32
    lane_bit = lanes % 32

    num_accepted = 0
    pos = 0
    # Rows are verified in order and only until the first mismatch, so rows
    # after a rejection are never read: `end` shrinks to pos + 1 on a mismatch.
    end = num_draft + 1
    while pos < end:
        row = (first_row + pos).to(tl.int64)
        logits_row = logits_ptr + row * logits_stride_row
        bitmask_row = bitmask_ptr + row * bitmask_stride_row

        best_logit = float("-inf")
        best_token = -1
        for v0 in range(0, vocab_size, BLOCK_V):
            in_vocab = lanes < vocab_size - v0
            words = tl.load(bitmask_row + v0 // 32 + lane_word, mask=in_vocab, other=0)
            allowed = in_vocab & (((words >> lane_bit) & 1) != 0)
            # Disallowed logits are never read: less traffic under sparse grammars.
            x = tl.load(logits_row + v0 + lanes, mask=allowed, other=float("-inf")).to(tl.float32)
            # `x > -inf` is also False for NaN, so NaN logits behave like masked tokens.
            x = tl.where(allowed & (x > float("-inf")), x, float("-inf"))
            tile_max, tile_arg = tl.max(x, axis=0, return_indices=True, return_indices_tie_break_left=True)
            # Strict `>` keeps the earlier tile on ties, so the lowest token id
            # wins overall; a tile with nothing usable (max = -inf) never wins.
            better = tile_max > best_logit
            best_logit = tl.where(better, tile_max, best_logit)
            best_token = tl.where(better, v0 + tile_arg, best_token)

        has_draft = pos < num_draft
        draft = tl.load(draft_tokens_ptr + draft_start + pos, mask=has_draft, other=-1).to(tl.int32)
        accept = has_draft & (best_token >= 0) & (draft == best_token)
        # Accepted or not, the token emitted at `pos` is the target itself.
        tl.store(output_tokens_ptr + seq * out_stride + pos, best_token)
        num_accepted += accept.to(tl.int32)
        end = tl.where(accept, end, pos + 1)
        pos += 1

    tl.store(num_accepted_ptr + seq, num_accepted)


def verify_greedy_triton(
    logits: torch.Tensor,
    bitmask: torch.Tensor,
    draft_tokens: torch.Tensor,
    cu_num_draft: torch.Tensor,
    *,
    block_v: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Masked greedy verification of a ragged batch of drafts (Triton kernel).

    Args:
        logits: [sum(n_b) + B, V] float32/bfloat16/float16, any row stride but
            unit column stride; sequence b's rows are
            ``[cu_num_draft[b] + b, cu_num_draft[b + 1] + b + 1)``, the last one
            being its bonus row.
        bitmask: int32 [sum(n_b) + B, ceil(V / 32)], unit column stride; bit
            ``t % 32`` of word ``t // 32`` set = token t allowed.
        draft_tokens: int32/int64 [sum(n_b)], ids in [0, V).
        cu_num_draft: int32 [B + 1], offsets of each sequence's drafts.
        block_v: vocab tile size override (power of two >= 32), for tests.

    Returns:
        ``(output_tokens, num_accepted)``: int32 [B, max_n + 1] holding the
        accepted draft prefix then the correction/bonus token, padded with -1;
        and int32 [B] accepted-draft counts.  Identical to
        :func:`verify_greedy_torch` for the same inputs.  Inputs are not modified.

    Raises:
        TypeError / ValueError: on wrong dtypes, shapes, devices or offsets.
        RuntimeError: if triton is not importable.
    """
    batch = check_ragged_batch(logits, bitmask, draft_tokens, cu_num_draft)
    require_triton()
    output_tokens, num_accepted = new_outputs(batch, logits.device)
    if batch.num_seqs == 0:
        return output_tokens, num_accepted
    if block_v is None:
        block_v = _default_block_v(batch)
    check_block_v(block_v)
    _verify_greedy_kernel[(batch.num_seqs,)](
        logits_ptr=logits,
        bitmask_ptr=bitmask,
        draft_tokens_ptr=draft_tokens.contiguous(),
        cu_num_draft_ptr=cu_num_draft.contiguous(),
        output_tokens_ptr=output_tokens,
        num_accepted_ptr=num_accepted,
        vocab_size=batch.vocab_size,
        logits_stride_row=logits.stride(0),
        bitmask_stride_row=bitmask.stride(0),
        out_stride=output_tokens.stride(0),
        BLOCK_V=block_v,
        num_warps=8 if block_v >= 2048 else 4,
    )
    return output_tokens, num_accepted


def _default_block_v(batch: RaggedBatch) -> int:
    # On a GPU a 4096-token tile keeps 16 fp32 values per thread with 8 warps.
    # The interpreter pays per tile in Python, so it gets the largest tile.
    cap = 32768 if interpreter_enabled() else 4096
    return max(32, min(next_power_of_2(batch.vocab_size), cap))


def masked_argmax_torch(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """int64 [N]: per-row argmax over allowed, non-NaN, > -inf logits; lowest id on ties; -1 if none."""
    allowed = unpack_bitmask(bitmask, logits.shape[1])
    x = logits.float()
    usable = allowed & (x > float("-inf"))  # False for NaN as well
    masked = x.masked_fill(~usable, float("-inf"))
    target = masked.argmax(dim=-1)  # first occurrence of the maximum
    return torch.where(usable.any(dim=-1), target, torch.full_like(target, -1))


def ragged_to_padded(values: torch.Tensor, lengths: torch.Tensor, width: int, fill: int) -> torch.Tensor:
    """Scatter packed segments (segment b has ``lengths[b]`` entries) into a [B, width] grid.

    Entry ``[b, j]`` is element j of segment b, or ``fill`` past its end.
    """
    col = torch.arange(width, device=values.device)
    grid = torch.full((lengths.numel(), width), fill, dtype=values.dtype, device=values.device)
    # Packed order is segment-major then position, which is exactly the order
    # boolean-mask assignment walks a row-major grid.
    grid[col < lengths.unsqueeze(1)] = values
    return grid


def verify_greedy_torch(
    logits: torch.Tensor,
    bitmask: torch.Tensor,
    draft_tokens: torch.Tensor,
    cu_num_draft: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference for :func:`verify_greedy_triton`: same arguments, same results, same errors."""
    batch = check_ragged_batch(logits, bitmask, draft_tokens, cu_num_draft)
    if batch.num_seqs == 0:
        return new_outputs(batch, logits.device)
    return accept_targets(masked_argmax_torch(logits, bitmask), draft_tokens, cu_num_draft, batch.max_num_draft)


def accept_targets(target: torch.Tensor, draft_tokens: torch.Tensor, cu_num_draft: torch.Tensor,
                   max_num_draft: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy acceptance given each row's masked argmax `target` (int64 [sum(n_b) + B], -1 where
    the row allows nothing): verify_greedy's results, for a caller that computed the targets
    itself (the engine's native CPU path, kernels/cpu_layer.c)."""
    lengths = (cu_num_draft[1:] - cu_num_draft[:-1]).to(torch.int64)
    width = max_num_draft + 1
    target_grid = ragged_to_padded(target, lengths + 1, width, fill=-1)  # draft rows + bonus row
    draft_grid = ragged_to_padded(draft_tokens.to(torch.int64), lengths, width, fill=-2)  # never a target
    match = (target_grid >= 0) & (draft_grid == target_grid)
    accepted = match.to(torch.int64).cumprod(dim=1).sum(dim=1)  # length of the matching prefix
    # Accepted drafts equal their targets, so positions 0..accepted all hold targets.
    keep = torch.arange(width, device=target.device) <= accepted.unsqueeze(1)
    return torch.where(keep, target_grid, -1).to(torch.int32), accepted.to(torch.int32)
