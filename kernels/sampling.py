"""Grammar-masked speculative (rejection) sampling, Leviathan et al. 2023.

For sequence b and draft position j let ``p_j = softmax(masked_logits_j / T_b)``
(fp32; disallowed tokens, NaN and -inf logits get probability 0) and let
``q_j`` be the draft distribution (``draft_probs[j]``, or one-hot on the draft
token for deterministic proposers).  Draft token ``x = draft[j]`` is accepted
iff ``accept_uniform[j] <= min(1, p_j(x) / q_j(x))``; at the first rejection a
token is drawn from the residual ``max(p_j - q_j, 0)`` (or from ``p_j`` if that
residual is all zero), and if every draft is accepted one is drawn from the
bonus row's ``p``.  This makes each emitted token distributed exactly as the
masked target.

Draws use caller-supplied randomness so both backends are reproducible and
agree: a draw from weights ``d`` is ``argmax_t d(t) / sample_noise[b, t]``
over ``d(t) > 0`` with ``sample_noise ~ Exp(1)`` (the "exponential race";
``P(argmax = t) = d(t) / sum(d)``, so ``d`` need not be normalised).  One noise
row per sequence serves whichever row it draws from: each sequence draws exactly
once per call, and which row that is depends only on the acceptance uniforms,
which are independent of the noise, so the draw is still exact.

Float details both backends share, so that their decisions match: the
acceptance test is evaluated as ``p(x) > 0 and u * q(x) <= p(x)`` (the same
test without a division), ``p = exp(z - max z) / sum`` with ``z = logits / T``
computed by IEEE division, and the residual is left unnormalised.  The kernel
accumulates the softmax normaliser online, tile by tile, and its ``exp`` is not
torch's, so p agrees with the reference to a few ulps rather than bit for bit:
a decision can differ only when a comparison is that close to a tie.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from structspec.kernels._triton import interpreter_enabled, next_power_of_2, require_triton, tl, triton
from structspec.kernels._validate import (
    RaggedBatch,
    check_block_v,
    check_dtype,
    check_ndim,
    check_ragged_batch,
    check_ragged_layout,
    check_same_device,
    check_shape,
    check_tensor,
    check_unit_column_stride,
    new_outputs,
)
from structspec.kernels.bitmask import unpack_bitmask
from structspec.kernels.greedy import ragged_to_padded

__all__ = ["make_sampling_randoms", "verify_sampling_torch", "verify_sampling_triton"]


@triton.jit
def _scaled_logits_tile(
    logits_row,  # [V] fp32/bf16/fp16, one row of the logits
    bitmask_row,  # [ceil(V / 32)] int32, the same row of the bitmask
    v0,  # first token of the tile, a multiple of BLOCK_V
    vocab_size,
    temperature,  # fp32 scalar > 0
    BLOCK_V: tl.constexpr,
):
    """Returns (usable, z) for tokens v0 + [0, BLOCK_V): z = logit / T where usable, else -inf."""
    lanes = tl.arange(0, BLOCK_V)
    in_vocab = lanes < vocab_size - v0
    words = tl.load(bitmask_row + v0 // 32 + lanes // 32, mask=in_vocab, other=0)
    allowed = in_vocab & (((words >> (lanes % 32)) & 1) != 0)
    # Disallowed logits are never read: less traffic under sparse grammars.
    x = tl.load(logits_row + v0 + lanes, mask=allowed, other=float("-inf")).to(tl.float32)
    # div_rn is IEEE division like torch's; a plain `/` lowers to div.approx on NVIDIA.
    z = tl.div_rn(x, temperature)
    # `z > -inf` is also False for NaN, so NaN logits behave like masked tokens.
    usable = allowed & (z > float("-inf"))
    return usable, tl.where(usable, z, float("-inf"))


@triton.jit(do_not_specialize=["out_stride"])
def _verify_sampling_kernel(
    logits_ptr,  # [num_draft + B, V] fp32/bf16/fp16, unit column stride
    bitmask_ptr,  # [num_draft + B, ceil(V / 32)] int32, unit column stride
    draft_tokens_ptr,  # [num_draft] int32/int64
    cu_num_draft_ptr,  # [B + 1] int32
    temperature_ptr,  # [B] fp32 > 0
    accept_uniform_ptr,  # [num_draft] fp32 in (0, 1]
    sample_noise_ptr,  # [B, V] fp32 Exp(1) > 0 (one row per sequence), unit column stride
    draft_probs_ptr,  # [num_draft, V] fp32, unit column stride; unused unless HAS_DRAFT_PROBS
    output_tokens_ptr,  # [B, out_stride] int32, pre-filled with -1
    num_accepted_ptr,  # [B] int32
    vocab_size,
    logits_stride_row,
    bitmask_stride_row,
    noise_stride_row,
    draft_probs_stride_row,
    out_stride,  # max draft length + 1: changes every step, so not specialised
    HAS_DRAFT_PROBS: tl.constexpr,  # False: q is one-hot on the draft token
    BLOCK_V: tl.constexpr,  # vocab tile; a power of two >= 32 so tiles cover whole bitmask words
):
    seq = tl.program_id(0)
    draft_start = tl.load(cu_num_draft_ptr + seq)
    num_draft = tl.load(cu_num_draft_ptr + seq + 1) - draft_start
    # Sequence `seq` owns rows [draft_start + seq, draft_start + seq + num_draft].
    first_row = draft_start + seq
    temperature = tl.load(temperature_ptr + seq)
    lanes = tl.arange(0, BLOCK_V)

    num_accepted = 0
    pos = 0
    # Only rows up to the first rejection are read: `end` shrinks to pos + 1 there.
    end = num_draft + 1
    while pos < end:
        row = (first_row + pos).to(tl.int64)
        logits_row = logits_ptr + row * logits_stride_row
        bitmask_row = bitmask_ptr + row * bitmask_stride_row

        # Softmax max and normaliser in one online pass over the row.  While
        # nothing usable has been seen the max is -inf; exponents are then
        # taken relative to 0 instead, which keeps NaN (-inf - -inf) out.
        row_max = float("-inf")
        denom = 0.0
        for v0 in range(0, vocab_size, BLOCK_V):
            usable, z = _scaled_logits_tile(logits_row, bitmask_row, v0, vocab_size, temperature, BLOCK_V)
            new_max = tl.maximum(row_max, tl.max(z, axis=0))
            shift = tl.where(new_max > float("-inf"), new_max, 0.0)
            denom = denom * tl.exp(row_max - shift) + tl.sum(tl.where(usable, tl.exp(z - shift), 0.0), axis=0)
            row_max = new_max
        # A row with no usable token has p = 0 everywhere: shift by 0 and divide
        # by 1 so that its (discarded) probabilities are 0, not NaN.
        row_max = tl.where(row_max > float("-inf"), row_max, 0.0)
        denom = tl.where(denom > 0.0, denom, 1.0)

        # Acceptance test for the draft token x at this position, if any.
        has_draft = pos < num_draft
        draft_index = draft_start + pos
        x = tl.load(draft_tokens_ptr + draft_index, mask=has_draft, other=0).to(tl.int32)
        x_word = tl.load(bitmask_row + x // 32, mask=has_draft, other=0)
        x_logit = tl.load(logits_row + x, mask=has_draft, other=float("-inf")).to(tl.float32)
        x_z = tl.div_rn(x_logit, temperature)
        x_usable = has_draft & (((x_word >> (x % 32)) & 1) != 0) & (x_z > float("-inf"))
        p_x = tl.where(x_usable, tl.div_rn(tl.exp(x_z - row_max), denom), 0.0)
        if HAS_DRAFT_PROBS:
            draft_probs_row = draft_probs_ptr + draft_index.to(tl.int64) * draft_probs_stride_row
            q_x = tl.load(draft_probs_row + x, mask=has_draft, other=0.0)
        else:
            draft_probs_row = draft_probs_ptr
            q_x = 1.0
        u = tl.load(accept_uniform_ptr + draft_index, mask=has_draft, other=2.0)
        # `u <= p / q` without the division; `p(x) > 0` keeps a masked-out draft
        # from being accepted even when q(x) == 0.
        accept = has_draft & (p_x > 0.0) & (u * q_x <= p_x)

        if accept:
            tl.store(output_tokens_ptr + seq * out_stride + pos, x)
            num_accepted += 1
        else:
            # Draw one token by an exponential race: from max(p - q, 0) after a
            # rejection, from p on the bonus row.
            noise_row = sample_noise_ptr + seq.to(tl.int64) * noise_stride_row
            # q is subtracted only after a rejected draft (q = 0 on the bonus row).
            q_end = tl.where(has_draft, vocab_size, 0)  # draft_probs read for tokens < q_end
            q_token = tl.where(has_draft, x, -1)  # one-hot q's token, -1 = none
            best_score = -1.0  # candidates score >= 0, so -1 means "none yet"
            best_token = -1
            fallback_score = -1.0
            fallback_token = -1
            for v0 in range(0, vocab_size, BLOCK_V):
                usable, z = _scaled_logits_tile(logits_row, bitmask_row, v0, vocab_size, temperature, BLOCK_V)
                p = tl.where(usable, tl.div_rn(tl.exp(z - row_max), denom), 0.0)
                if HAS_DRAFT_PROBS:
                    q = tl.load(draft_probs_row + v0 + lanes, mask=lanes < q_end - v0, other=0.0)
                else:
                    q = tl.where(lanes == q_token - v0, 1.0, 0.0)
                residual = tl.maximum(p - q, 0.0)
                # Noise is only needed where p > 0 (residual > 0 implies p > 0).
                noise = tl.load(noise_row + v0 + lanes, mask=p > 0.0, other=1.0)
                score = tl.where(residual > 0.0, tl.div_rn(residual, noise), -1.0)
                tile_best, tile_arg = tl.max(score, axis=0, return_indices=True, return_indices_tie_break_left=True)
                # Strict `>` keeps the earlier tile on ties: the lowest token id wins.
                better = tile_best > best_score
                best_score = tl.where(better, tile_best, best_score)
                best_token = tl.where(better, v0 + tile_arg, best_token)
                if HAS_DRAFT_PROBS:
                    # If p == q the residual is all zero; then p itself is
                    # sampled, raced with the same noise in the same pass.
                    p_score = tl.where(p > 0.0, tl.div_rn(p, noise), -1.0)
                    tile_best, tile_arg = tl.max(
                        p_score, axis=0, return_indices=True, return_indices_tie_break_left=True
                    )
                    better = tile_best > fallback_score
                    fallback_score = tl.where(better, tile_best, fallback_score)
                    fallback_token = tl.where(better, v0 + tile_arg, fallback_token)
            # With one-hot q no fallback is needed: the residual is all zero only
            # if p(x) == 1, and then x was accepted (u <= 1), or if the row has no
            # usable token, where p is all zero as well.
            if HAS_DRAFT_PROBS:
                best_token = tl.where(best_token >= 0, best_token, fallback_token)
            tl.store(output_tokens_ptr + seq * out_stride + pos, best_token)
            end = pos + 1
        pos += 1

    tl.store(num_accepted_ptr + seq, num_accepted)


def _check_sampling_args(
    logits: torch.Tensor,
    bitmask: torch.Tensor,
    draft_tokens: torch.Tensor,
    cu_num_draft: torch.Tensor,
    temperature: torch.Tensor,
    accept_uniform: torch.Tensor,
    sample_noise: torch.Tensor,
    draft_probs: torch.Tensor | None,
) -> RaggedBatch:
    """Checks shared by both backends; the layout first, as the other shapes derive from it."""
    num_seqs, num_draft, vocab_size = check_ragged_layout(logits, bitmask, draft_tokens, cu_num_draft)
    for name, t in (("temperature", temperature), ("accept_uniform", accept_uniform), ("sample_noise", sample_noise)):
        check_tensor(name, t)
        check_dtype(name, t, (torch.float32,))
    check_shape("temperature", temperature, (num_seqs,), "one per sequence")
    check_shape("accept_uniform", accept_uniform, (num_draft,), "one per draft token")
    check_shape("sample_noise", sample_noise, (num_seqs, vocab_size), "one row per sequence")
    if draft_probs is not None:
        check_tensor("draft_probs", draft_probs)
        check_dtype("draft_probs", draft_probs, (torch.float32,))
        check_shape("draft_probs", draft_probs, (num_draft, vocab_size), "one row per draft token")
        check_unit_column_stride("draft_probs", draft_probs)
    check_unit_column_stride("sample_noise", sample_noise)
    check_same_device(
        "logits",
        logits,
        temperature=temperature,
        accept_uniform=accept_uniform,
        sample_noise=sample_noise,
        draft_probs=draft_probs,
    )
    temperature_ok = (torch.isfinite(temperature) & (temperature > 0)).all()
    return check_ragged_batch(
        logits,
        bitmask,
        draft_tokens,
        cu_num_draft,
        value_checks={"temperature must be finite and > 0": temperature_ok},
    )


def verify_sampling_triton(
    logits: torch.Tensor,
    bitmask: torch.Tensor,
    draft_tokens: torch.Tensor,
    cu_num_draft: torch.Tensor,
    temperature: torch.Tensor,
    accept_uniform: torch.Tensor,
    sample_noise: torch.Tensor,
    draft_probs: torch.Tensor | None = None,
    *,
    block_v: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Masked speculative sampling verification of a ragged batch (Triton kernel).

    Args:
        logits, bitmask, draft_tokens, cu_num_draft: the ragged layout of
            :func:`structspec.kernels.greedy.verify_greedy_triton`.
        temperature: float32 [B], finite and > 0.
        accept_uniform: float32 [sum(n_b)], uniforms in (0, 1], one per draft token.
        sample_noise: float32 [B, V], Exp(1) samples > 0; row b is used for
            sequence b's one draw, at whichever of its rows that happens.
        draft_probs: float32 [sum(n_b), V] draft distributions q, or None for
            one-hot q on the draft tokens.
        block_v: vocab tile size override (power of two >= 32), for tests.

    Returns:
        ``(output_tokens, num_accepted)`` as for greedy verification: int32
        [B, max_n + 1] (accepted prefix, then the resampled/bonus token, then
        -1 padding) and int32 [B].  A drawn token is -1 if its row allows no
        token.  Inputs are not modified; matches :func:`verify_sampling_torch`.

    Raises:
        TypeError / ValueError: on wrong dtypes, shapes, devices or values.
        RuntimeError: if triton is not importable.
    """
    batch = _check_sampling_args(
        logits, bitmask, draft_tokens, cu_num_draft, temperature, accept_uniform, sample_noise, draft_probs
    )
    require_triton()
    output_tokens, num_accepted = new_outputs(batch, logits.device)
    if batch.num_seqs == 0:
        return output_tokens, num_accepted
    if block_v is None:
        block_v = max(32, min(next_power_of_2(batch.vocab_size), 32768 if interpreter_enabled() else 2048))
    check_block_v(block_v)
    has_draft_probs = draft_probs is not None
    # Never dereferenced when HAS_DRAFT_PROBS is False; any fp32 tensor will do.
    probs = draft_probs if has_draft_probs else sample_noise
    _verify_sampling_kernel[(batch.num_seqs,)](
        logits_ptr=logits,
        bitmask_ptr=bitmask,
        draft_tokens_ptr=draft_tokens.contiguous(),
        cu_num_draft_ptr=cu_num_draft.contiguous(),
        temperature_ptr=temperature.contiguous(),
        accept_uniform_ptr=accept_uniform.contiguous(),
        sample_noise_ptr=sample_noise,
        draft_probs_ptr=probs,
        output_tokens_ptr=output_tokens,
        num_accepted_ptr=num_accepted,
        vocab_size=batch.vocab_size,
        logits_stride_row=logits.stride(0),
        bitmask_stride_row=bitmask.stride(0),
        noise_stride_row=sample_noise.stride(0),
        draft_probs_stride_row=probs.stride(0),
        out_stride=output_tokens.stride(0),
        HAS_DRAFT_PROBS=has_draft_probs,
        BLOCK_V=block_v,
        num_warps=8 if block_v >= 2048 else 4,
    )
    return output_tokens, num_accepted


def masked_probs_torch(logits: torch.Tensor, bitmask: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """float32 [N, V] target distributions p = softmax(masked logits / T) per row.

    ``temperature`` is float32 [N] (one per row).  Disallowed tokens and NaN or
    -inf logits get p = 0; a row with no usable token is all zero.
    """
    z = logits.float() / temperature.unsqueeze(1)
    usable = unpack_bitmask(bitmask, logits.shape[1]) & (z > float("-inf"))
    z = z.masked_fill(~usable, float("-inf"))
    row_max = z.amax(dim=1, keepdim=True)
    # Unusable entries may be NaN here (-inf - -inf); the where() discards them.
    weights = torch.where(usable, torch.exp(z - row_max), 0.0)
    denom = weights.sum(dim=1, keepdim=True)
    return torch.where(usable, weights / denom, 0.0)


def exponential_race_torch(weights: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """int64 [N]: per-row argmax_t weights / noise over weights > 0 (lowest t on ties), -1 if none."""
    candidate = weights > 0
    score = torch.where(candidate, weights / noise, -1.0)
    token = score.argmax(dim=1)
    return torch.where(candidate.any(dim=1), token, -1)


def verify_sampling_torch(
    logits: torch.Tensor,
    bitmask: torch.Tensor,
    draft_tokens: torch.Tensor,
    cu_num_draft: torch.Tensor,
    temperature: torch.Tensor,
    accept_uniform: torch.Tensor,
    sample_noise: torch.Tensor,
    draft_probs: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference for :func:`verify_sampling_triton`: same arguments, same results, same errors."""
    batch = _check_sampling_args(
        logits, bitmask, draft_tokens, cu_num_draft, temperature, accept_uniform, sample_noise, draft_probs
    )
    output_tokens, num_accepted = new_outputs(batch, logits.device)
    if batch.num_seqs == 0:
        return output_tokens, num_accepted
    device = logits.device
    lengths = (cu_num_draft[1:] - cu_num_draft[:-1]).to(torch.int64)
    seq_of_row = torch.repeat_interleave(torch.arange(batch.num_seqs, device=device), lengths + 1)
    probs = masked_probs_torch(logits, bitmask, temperature[seq_of_row])

    # Acceptance of every draft token (only the prefix before the first
    # rejection matters).  Draft i sits at packed row i + (its sequence index).
    seq_of_draft = torch.repeat_interleave(torch.arange(batch.num_seqs, device=device), lengths)
    draft = draft_tokens.to(torch.int64)
    draft_row = torch.arange(batch.num_draft, device=device) + seq_of_draft
    p_x = probs[draft_row, draft]
    if draft_probs is None:
        q_x = torch.ones_like(p_x)
    else:
        q_x = draft_probs[torch.arange(batch.num_draft, device=device), draft]
    accept = (p_x > 0) & (accept_uniform * q_x <= p_x)

    width = batch.max_num_draft + 1
    accept_grid = ragged_to_padded(accept.to(torch.int64), lengths, width, fill=0)
    accepted = accept_grid.cumprod(dim=1).sum(dim=1)  # length of the accepted prefix

    # Each sequence draws exactly one token, at row cu[b] + b + accepted[b].
    seq = torch.arange(batch.num_seqs, device=device)
    cu = cu_num_draft.to(torch.int64)
    row = cu[:-1] + seq + accepted
    rejected = accepted < lengths
    p = probs[row]
    q = torch.zeros_like(p)
    rej_draft = (cu[:-1] + accepted)[rejected]  # the rejected draft's index
    if draft_probs is None:
        q[rejected, draft[rej_draft]] = 1.0
    else:
        q[rejected] = draft_probs[rej_draft]
    token = exponential_race_torch(torch.clamp(p - q, min=0), sample_noise)
    # An all-zero residual (p == q) falls back to p.
    fallback = exponential_race_torch(p, sample_noise)
    token = torch.where(token < 0, fallback, token)

    # Columns j < accepted hold the accepted drafts, then the drawn token, then -1.
    draft_grid = ragged_to_padded(draft, lengths, width, fill=-1)
    col = torch.arange(width, device=device)
    out = torch.where(col < accepted.unsqueeze(1), draft_grid, -1)
    out[seq, accepted] = token
    output_tokens.copy_(out.to(torch.int32))
    num_accepted.copy_(accepted.to(torch.int32))
    return output_tokens, num_accepted


def make_sampling_randoms(
    cu_num_draft: torch.Tensor,
    vocab_size: int,
    generators: Sequence[torch.Generator],
    device: torch.device | str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw ``(accept_uniform, sample_noise)`` for :func:`verify_sampling_triton` / ``_torch``.

    Sequence b's randomness comes only from ``generators[b]`` (drawn on that
    generator's device, then moved to ``device``), so a sequence's draws do not
    depend on what else is in the batch.  Per sequence, in this order:
    ``n_b`` uniforms ``1 - U[0, 1)``, which lie in (0, 1] (never 0); then
    ``vocab_size`` Exp(1) samples (the one row its draw races on) clamped to at
    least the smallest normal float32, so they are strictly positive.  The Exp(1) samples are
    ``-log1p(-U)`` of float64 uniforms (inversion): on a CPU, torch's
    ``exponential_`` draws one value at a time, slower over a vocabulary
    (docs/benchmarks.md).  float64 matters: the race is decided by the smallest draws, and
    a float32 ``U`` would give ``0`` once in 2**24 draws, a token that then wins
    whatever its probability (over a 49k vocabulary, ~0.3% of the rows).

    Returns float32 ``accept_uniform [sum n_b]`` and ``sample_noise
    [B, vocab_size]`` on ``device``.  Reads ``cu_num_draft`` on the host.
    """
    check_tensor("cu_num_draft", cu_num_draft)
    check_dtype("cu_num_draft", cu_num_draft, (torch.int32,))
    check_ndim("cu_num_draft", cu_num_draft, 1, "[B + 1]")
    if cu_num_draft.numel() < 1:
        raise ValueError("cu_num_draft must have B + 1 >= 1 entries, got an empty tensor")
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 1:
        raise ValueError(f"vocab_size must be a positive int, got {vocab_size!r}")
    offsets = cu_num_draft.tolist()
    lengths = [end - start for start, end in zip(offsets, offsets[1:])]
    if offsets[0] != 0 or any(n < 0 for n in lengths):
        raise ValueError("cu_num_draft must start at 0 and be non-decreasing")
    if len(generators) != len(lengths):
        raise ValueError(f"need one generator per sequence: got {len(generators)} for B = {len(lengths)}")
    tiny = torch.finfo(torch.float32).tiny
    uniforms, noises = [], []
    for n, gen in zip(lengths, generators):
        if not isinstance(gen, torch.Generator):
            raise TypeError(f"generators must hold torch.Generator objects, got {type(gen).__name__}")
        u = torch.rand(n, generator=gen, device=gen.device, dtype=torch.float32)
        uniforms.append((1.0 - u).to(device))
        noise = torch.rand(1, vocab_size, generator=gen, device=gen.device, dtype=torch.float64)
        noises.append(noise.neg_().log1p_().neg_().to(torch.float32).clamp_(min=tiny).to(device))
    if not uniforms:
        return torch.empty(0, device=device), torch.empty(0, vocab_size, device=device)
    return torch.cat(uniforms), torch.cat(noises)
