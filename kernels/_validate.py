"""Host-side argument checks shared by the launchers and the torch references.

Both backends run the same checks so that a bad call fails identically (same
exception type, same message) whichever backend the dispatcher picked.
Static properties (types, dtypes, shapes, devices) are checked without
touching the data; the few value checks (offsets are consistent, draft tokens
are in the vocabulary, temperatures are positive) are batched into a single
device-to-host transfer, which the launchers need anyway to size the output.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

LOGIT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
TOKEN_DTYPES = (torch.int32, torch.int64)


def _dtype_names(dtypes: Sequence[torch.dtype]) -> str:
    return " or ".join(str(d).removeprefix("torch.") for d in dtypes)


def check_tensor(name: str, value: object) -> torch.Tensor:
    """Return ``value`` if it is a tensor, else raise ``TypeError``."""
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    return value


def check_dtype(name: str, t: torch.Tensor, allowed: Sequence[torch.dtype]) -> None:
    """Raise ``TypeError`` unless ``t.dtype`` is one of ``allowed``."""
    if t.dtype not in allowed:
        raise TypeError(f"{name} must have dtype {_dtype_names(allowed)}, got {t.dtype}")


def check_shape(name: str, t: torch.Tensor, expected: tuple[int, ...], what: str) -> None:
    """Raise ``ValueError`` unless ``t.shape == expected``; ``what`` explains the expectation."""
    if tuple(t.shape) != tuple(expected):
        raise ValueError(f"{name} must have shape {list(expected)} ({what}), got {list(t.shape)}")


def check_ndim(name: str, t: torch.Tensor, ndim: int, what: str) -> None:
    """Raise ``ValueError`` unless ``t`` has ``ndim`` dimensions."""
    if t.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D {what}, got shape {list(t.shape)}")


def check_same_device(reference_name: str, reference: torch.Tensor, **others: torch.Tensor | None) -> None:
    """Raise ``ValueError`` naming the first tensor not on ``reference``'s device."""
    for name, t in others.items():
        if t is not None and t.device != reference.device:
            raise ValueError(
                f"{name} is on {t.device} but {reference_name} is on {reference.device}; "
                "all inputs must be on the same device"
            )


def check_unit_column_stride(name: str, t: torch.Tensor) -> None:
    """Raise ``ValueError`` unless a 2-D tensor's rows are contiguous (the kernels index columns directly)."""
    if t.dim() == 2 and t.shape[1] > 1 and t.stride(1) != 1:
        raise ValueError(
            f"{name} must have contiguous rows (column stride 1), got strides {list(t.stride())}; "
            "pass .contiguous()"
        )


def check_bitmask(bitmask: torch.Tensor, num_rows: int, vocab_size: int, rows_what: str) -> None:
    """Check a packed int32 allow-mask for ``num_rows`` rows of ``vocab_size`` tokens."""
    check_tensor("bitmask", bitmask)
    check_dtype("bitmask", bitmask, (torch.int32,))
    check_shape(
        "bitmask",
        bitmask,
        (num_rows, (vocab_size + 31) // 32),
        f"{rows_what}, ceil(vocab_size / 32) int32 words per row",
    )
    check_unit_column_stride("bitmask", bitmask)


def check_block_v(block_v: int) -> None:
    """Raise ``ValueError`` unless ``block_v`` is a power of two >= 32 (whole bitmask words)."""
    if not isinstance(block_v, int) or block_v < 32 or block_v & (block_v - 1):
        raise ValueError(f"block_v must be a power of two >= 32, got {block_v!r}")


@dataclass(frozen=True)
class RaggedBatch:
    """Sizes of a validated ragged verification batch."""

    num_seqs: int  # B
    num_draft: int  # sum of draft lengths
    vocab_size: int  # V
    max_num_draft: int  # max draft length (0 for an empty batch)

    @property
    def num_rows(self) -> int:
        """Packed logits rows: one per draft token plus one bonus row per sequence."""
        return self.num_draft + self.num_seqs


def check_ragged_layout(
    logits: torch.Tensor,
    bitmask: torch.Tensor,
    draft_tokens: torch.Tensor,
    cu_num_draft: torch.Tensor,
) -> tuple[int, int, int]:
    """Static checks of the ragged layout; returns ``(num_seqs, num_draft, vocab_size)``.

    Looks only at types, dtypes, shapes, strides and devices (no data).
    """
    check_tensor("logits", logits)
    check_tensor("draft_tokens", draft_tokens)
    check_tensor("cu_num_draft", cu_num_draft)
    check_dtype("logits", logits, LOGIT_DTYPES)
    check_dtype("draft_tokens", draft_tokens, TOKEN_DTYPES)
    check_dtype("cu_num_draft", cu_num_draft, (torch.int32,))
    check_ndim("logits", logits, 2, "[sum(n_b) + B, V]")
    check_ndim("draft_tokens", draft_tokens, 1, "[sum(n_b)]")
    check_ndim("cu_num_draft", cu_num_draft, 1, "[B + 1]")
    if cu_num_draft.numel() < 1:
        raise ValueError("cu_num_draft must have B + 1 >= 1 entries, got an empty tensor")
    num_rows, vocab_size = logits.shape
    if vocab_size < 1:
        raise ValueError("logits must have at least one vocabulary column")
    num_seqs = cu_num_draft.numel() - 1
    num_draft = draft_tokens.numel()
    if num_rows != num_draft + num_seqs:
        raise ValueError(
            f"logits has {num_rows} rows but sum(n_b) + B = {num_draft} + {num_seqs} = "
            f"{num_draft + num_seqs} (one row per draft token plus one bonus row per sequence)"
        )
    check_unit_column_stride("logits", logits)
    check_bitmask(bitmask, num_rows, vocab_size, "one row per logits row")
    check_same_device("logits", logits, bitmask=bitmask, draft_tokens=draft_tokens, cu_num_draft=cu_num_draft)
    return num_seqs, num_draft, vocab_size


def check_ragged_batch(
    logits: torch.Tensor,
    bitmask: torch.Tensor,
    draft_tokens: torch.Tensor,
    cu_num_draft: torch.Tensor,
    value_checks: Mapping[str, torch.Tensor] | None = None,
) -> RaggedBatch:
    """Validate the ragged layout shared by the verification kernels.

    Runs :func:`check_ragged_layout`, then checks the offsets and draft token
    ids.  ``value_checks`` maps an error message to a 0-d bool tensor (on the
    logits' device) that must be true; all values come back in one host
    transfer.  Raises ``TypeError`` for wrong types/dtypes and ``ValueError``
    for wrong shapes, devices or inconsistent values.
    """
    num_seqs, num_draft, vocab_size = check_ragged_layout(logits, bitmask, draft_tokens, cu_num_draft)
    cu = cu_num_draft.to(torch.int64)
    lengths = cu[1:] - cu[:-1]
    checks: dict[str, torch.Tensor] = {
        "cu_num_draft[0] must be 0": cu[0] == 0,
        "cu_num_draft must be non-decreasing (draft lengths >= 0)": (lengths >= 0).all(),
        f"cu_num_draft[-1] must equal len(draft_tokens) = {num_draft}": cu[-1] == num_draft,
        f"draft_tokens must be token ids in [0, {vocab_size})": (
            (draft_tokens >= 0) & (draft_tokens < vocab_size)
        ).all(),
    }
    for message, ok in (value_checks or {}).items():
        checks[message] = ok.reshape(())
    max_len = torch.cat([lengths, lengths.new_zeros(1)]).max()
    # One transfer for every value check plus the output width.
    fetched = torch.stack([max_len] + [ok.to(torch.int64) for ok in checks.values()]).tolist()
    for message, ok in zip(checks, fetched[1:]):
        if not ok:
            raise ValueError(message)
    return RaggedBatch(num_seqs, num_draft, vocab_size, int(fetched[0]))


def new_outputs(batch: RaggedBatch, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Fresh ``(output_tokens [B, max_n + 1] filled with -1, num_accepted [B] zeros)``."""
    output_tokens = torch.full((batch.num_seqs, batch.max_num_draft + 1), -1, dtype=torch.int32, device=device)
    num_accepted = torch.zeros(batch.num_seqs, dtype=torch.int32, device=device)
    return output_tokens, num_accepted
