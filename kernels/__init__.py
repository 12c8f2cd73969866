"""Grammar-constrained verification kernels for speculative decoding.

Public entry points pick a backend per call:

* ``"triton"``: the Triton kernels (CUDA, or the CPU interpreter when
  ``TRITON_INTERPRET=1`` was set before triton was imported);
* ``"torch"``: readable torch references with identical results;
* ``"auto"`` (default): Triton when the logits are on CUDA or
  ``TRITON_INTERPRET=1`` is set and triton imports, otherwise torch.

Submodules (and with them triton) are imported on first use, so importing
this package is cheap and the torch backend works where ``import triton``
fails.  All functions validate their arguments and raise ``TypeError`` /
``ValueError`` naming the offending argument.

Layout (a ragged batch of B sequences, sequence b with n_b >= 0 draft tokens):
``cu_num_draft`` int32 [B + 1] holds draft offsets; ``draft_tokens`` int32/int64
[sum n_b] packs the drafts; ``logits`` [sum n_b + B, V] packs n_b + 1 rows per
sequence (row j < n_b verifies draft j, row n_b is the bonus row), sequence b's
rows being ``[cu_num_draft[b] + b, cu_num_draft[b + 1] + b + 1)``; ``bitmask``
int32 [sum n_b + B, ceil(V / 32)] has bit ``t % 32`` of word ``t // 32`` set when
token t is allowed.  Results: ``output_tokens`` int32 [B, max n_b + 1] (accepted
draft prefix, then the correction/bonus token, then -1 padding) and
``num_accepted`` int32 [B]; an emitted -1 means the row allowed no token.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch

__all__ = [
    "Backend",
    "apply_bitmask_inplace",
    "make_sampling_randoms",
    "resolve_backend",
    "verify_greedy",
    "verify_sampling",
]

Backend = Literal["auto", "triton", "torch"]

_BACKENDS = ("auto", "triton", "torch")


def resolve_backend(backend: Backend, device: torch.device) -> Literal["triton", "torch"]:
    """The concrete backend ``backend`` means for tensors on ``device``.

    Raises ``ValueError`` for an unknown backend name.  ``"auto"`` never picks
    Triton when triton failed to import.
    """
    if backend not in _BACKENDS:
        raise ValueError(f"backend must be one of {_BACKENDS}, got {backend!r}")
    if backend != "auto":
        return backend
    from structspec.kernels._triton import interpreter_enabled, triton_available

    if (device.type == "cuda" or interpreter_enabled()) and triton_available():
        return "triton"
    return "torch"


def _device_of(logits: object) -> torch.device:
    # Argument validation happens in the implementations; this only has to
    # survive a non-tensor long enough for them to report it.
    return logits.device if isinstance(logits, torch.Tensor) else torch.device("cpu")


def verify_greedy(
    logits: torch.Tensor,
    bitmask: torch.Tensor,
    draft_tokens: torch.Tensor,
    cu_num_draft: torch.Tensor,
    backend: Backend = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Masked greedy verification: accept drafts while they equal the masked argmax.

    Target at each row = argmax of the logits over allowed tokens (lowest id on
    ties; NaN/-inf logits count as disallowed).  Returns
    ``(output_tokens [B, max_n + 1], num_accepted [B])``, both int32, new tensors
    on the logits' device.  See :func:`structspec.kernels.greedy.verify_greedy_triton`.
    """
    if resolve_backend(backend, _device_of(logits)) == "triton":
        from structspec.kernels.greedy import verify_greedy_triton

        return verify_greedy_triton(logits, bitmask, draft_tokens, cu_num_draft)
    from structspec.kernels.greedy import verify_greedy_torch

    return verify_greedy_torch(logits, bitmask, draft_tokens, cu_num_draft)


def verify_sampling(
    logits: torch.Tensor,
    bitmask: torch.Tensor,
    draft_tokens: torch.Tensor,
    cu_num_draft: torch.Tensor,
    temperature: torch.Tensor,
    accept_uniform: torch.Tensor,
    sample_noise: torch.Tensor,
    draft_probs: torch.Tensor | None = None,
    backend: Backend = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Masked speculative (rejection) sampling with caller-supplied randomness.

    ``temperature`` float32 [B] > 0; ``accept_uniform`` float32 [sum n_b] in
    (0, 1]; ``sample_noise`` float32 [B, V] Exp(1) > 0, a row per sequence (see
    :func:`make_sampling_randoms`); ``draft_probs`` float32 [sum n_b, V] or None
    for one-hot drafts.  Each emitted token is distributed as the masked,
    temperature-scaled target.  Returns ``(output_tokens, num_accepted)`` as
    :func:`verify_greedy`.  See :func:`structspec.kernels.sampling.verify_sampling_triton`.
    """
    args = (logits, bitmask, draft_tokens, cu_num_draft, temperature, accept_uniform, sample_noise, draft_probs)
    if resolve_backend(backend, _device_of(logits)) == "triton":
        from structspec.kernels.sampling import verify_sampling_triton

        return verify_sampling_triton(*args)
    from structspec.kernels.sampling import verify_sampling_torch

    return verify_sampling_torch(*args)


def apply_bitmask_inplace(logits: torch.Tensor, bitmask: torch.Tensor, backend: Backend = "auto") -> None:
    """Set disallowed logits to -inf in place (``logits`` [N, V], ``bitmask`` int32 [N, ceil(V / 32)])."""
    if resolve_backend(backend, _device_of(logits)) == "triton":
        from structspec.kernels.bitmask import apply_bitmask_inplace_triton

        apply_bitmask_inplace_triton(logits, bitmask)
        return
    from structspec.kernels.bitmask import apply_bitmask_inplace_torch

    apply_bitmask_inplace_torch(logits, bitmask)


def make_sampling_randoms(
    cu_num_draft: torch.Tensor,
    vocab_size: int,
    generators: Sequence[torch.Generator],
    device: torch.device | str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sequence reproducible ``(accept_uniform, sample_noise)`` for :func:`verify_sampling`.

    One generator per sequence; uniforms lie in (0, 1] and the Exp(1) noise is
    strictly positive.  See :func:`structspec.kernels.sampling.make_sampling_randoms`.
    """
    from structspec.kernels.sampling import make_sampling_randoms as _make

    return _make(cu_num_draft, vocab_size, generators, device)
