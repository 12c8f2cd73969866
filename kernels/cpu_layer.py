"""The elementwise steps of a decoder layer on a CPU, fused in C (kernels/cpu_layer.c).

The lean forward (structspec/engine/lean.py) runs four GEMMs and the attention per layer; what
lies between them, residual adds, RMSNorm, rotary embeddings and the gated SiLU, is ~20 eager
operators per layer, each a pass over memory plus microseconds of dispatch: ~7 ms of a 45 ms
16-row bf16 decode pass and ~40 ms of a 150 ms 512-token prefill chunk on this project's CPU
(docs/benchmarks.md). These functions do the same in three calls, one pass each:

* ``add_rms_norm(x, y, weight, eps)``: x += y in place (y may be None), returns RMSNorm(x);
* ``rotary_(qk, cos, sin, heads, head_dim)``: rotary embedding in place on the first
  ``heads * head_dim`` columns of each row;
* ``silu_mul(gate_up)``: silu(gate) * up of [rows, 2n] -> [rows, n];

and, after the last layer, greedy verification's masked argmax over the logits (with the masked
softmax's log-partition for the emitted tokens' confidence), in one pass per row where torch
needs an unpacked mask and four passes (~16 ms for 54 rows of a 49k vocabulary on this
project's CPU, docs/benchmarks.md):

* ``masked_argmax(logits, bitmask, rows, logz)``: per row, the argmax over the tokens the
  grammar allows, bit-identical to kernels.greedy.masked_argmax_torch, and optionally
  log sum exp over them.

Arithmetic as cpu_layer.c's header says: rotary and the add bit-identical to eager torch,
RMSNorm and SiLU within the last bits of fp32 (in bf16: one unit in the last place at a rounding
boundary). fp32 or bf16, rows of any stride with a unit last stride. Built at first use by
kernels/native.py (``load`` raises ``RuntimeError`` saying why not).
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from structspec.kernels import native

__all__ = ["LayerOps", "load"]

SOURCE = Path(__file__).with_name("cpu_layer.c")
FLAGS = ("-ffp-contract=off",)  # no product fused into an add: rotary and the add round as torch does
_DTYPES = (torch.float32, torch.bfloat16)


def _rows(t: torch.Tensor, name: str, dtype: torch.dtype | None = None) -> None:
    if t.dim() != 2 or t.stride(1) != 1:
        raise ValueError(f"{name} must be 2-D [rows, n] with a unit last stride, got shape {tuple(t.shape)} "
                         f"strides {t.stride()}")
    if t.dtype not in _DTYPES or (dtype is not None and t.dtype != dtype):
        raise ValueError(f"{name} must be {dtype or 'fp32 or bf16'}, got {t.dtype}")
    if t.device.type != "cpu":
        raise ValueError(f"{name} must be on the CPU, got {t.device}")


class LayerOps:
    """The compiled library (one per CPU and build flags; it does not depend on the model)."""

    def __init__(self, path: Path):
        self.path = path
        lib = native.open_library(path, SOURCE, "structspec_layer_version", 3)
        i64, ptr, c_int, c_float = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int, ctypes.c_float
        self._norm = lib.structspec_add_rms_norm
        self._norm.argtypes = [ptr, i64, ptr, i64, ptr, ptr, i64, i64, i64, c_float, c_int, c_int]
        self._rotary = lib.structspec_rotary
        self._rotary.argtypes = [ptr, i64, i64, i64, ptr, ptr, i64, i64, c_int, c_int]
        self._silu = lib.structspec_silu_mul
        self._silu.argtypes = [ptr, i64, ptr, i64, i64, i64, c_int, c_int]
        self._argmax = lib.structspec_masked_argmax
        self._argmax.argtypes = [ptr, i64, ptr, i64, ptr, i64, i64, ptr, ptr, c_int, c_int]
        self._round = lib.structspec_round_bf16
        self._round.argtypes = [ptr, ptr, i64, c_int]
        for fn in (self._norm, self._rotary, self._silu, self._argmax, self._round):
            fn.restype = None
        self._lib = lib

    def add_rms_norm(self, x: torch.Tensor, y: torch.Tensor | None, weight: torch.Tensor, eps: float,
                     threads: int | None = None, check: bool = True) -> torch.Tensor:
        """x += y in place (skipped when y is None); returns RMSNorm(x) * weight, a new [rows, n].
        check=False (here and in the other steps) skips the argument checks: for a caller that
        passes what it passed before, but for the row count (the lean forward, whose checks per
        call cost more than a one-row step's C work)."""
        if check:
            self._check_norm(x, y, weight)
        out = torch.empty(x.shape, dtype=x.dtype)
        self._norm(x.data_ptr(), x.stride(0), None if y is None else y.data_ptr(), 0 if y is None else y.stride(0),
                   weight.data_ptr(), out.data_ptr(), out.stride(0), x.shape[0], x.shape[1], eps,
                   int(x.dtype == torch.bfloat16), threads or torch.get_num_threads())
        return out

    @staticmethod
    def _check_norm(x: torch.Tensor, y: torch.Tensor | None, weight: torch.Tensor) -> None:
        _rows(x, "x")
        if y is not None:
            _rows(y, "y", x.dtype)
            if y.shape != x.shape:
                raise ValueError(f"y {tuple(y.shape)} and x {tuple(x.shape)} differ in shape")
        if weight.dtype != x.dtype or weight.shape != (x.shape[1],) or not weight.is_contiguous():
            raise ValueError(f"weight must be contiguous {x.dtype} [{x.shape[1]}], got {weight.dtype} "
                             f"{tuple(weight.shape)}")

    def rotary_(self, qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int, head_dim: int,
                threads: int | None = None, check: bool = True) -> None:
        """Rotary embedding in place on columns [0, heads * head_dim) of qk [rows, >= that], with
        cos and sin [rows, head_dim] of qk's dtype."""
        if check:
            self._check_rotary(qk, cos, sin, heads, head_dim)
        self._rotary(qk.data_ptr(), qk.stride(0), heads, head_dim, cos.data_ptr(), sin.data_ptr(), cos.stride(0),
                     qk.shape[0], int(qk.dtype == torch.bfloat16), threads or torch.get_num_threads())

    @staticmethod
    def _check_rotary(qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int, head_dim: int) -> None:
        _rows(qk, "qk")
        for t, name in ((cos, "cos"), (sin, "sin")):
            _rows(t, name, qk.dtype)
            if t.shape != (qk.shape[0], head_dim):
                raise ValueError(f"{name} must be [{qk.shape[0]}, {head_dim}], got {tuple(t.shape)}")
        if cos.stride(0) != sin.stride(0):
            raise ValueError("cos and sin must share a row stride")
        if head_dim % 2 or heads * head_dim > qk.shape[1]:
            raise ValueError(f"{heads} heads of {head_dim} do not fit rows of {qk.shape[1]} (or {head_dim} is odd)")

    def silu_mul(self, gate_up: torch.Tensor, threads: int | None = None, check: bool = True) -> torch.Tensor:
        """silu(gate_up[:, :n]) * gate_up[:, n:], a new [rows, n] (n = half of gate_up's width)."""
        if check:
            _rows(gate_up, "gate_up")
            if gate_up.shape[1] % 2:
                raise ValueError(f"gate_up's width {gate_up.shape[1]} is odd")
        n = gate_up.shape[1] // 2
        out = torch.empty(gate_up.shape[0], n, dtype=gate_up.dtype)
        self._silu(gate_up.data_ptr(), gate_up.stride(0), out.data_ptr(), out.stride(0), gate_up.shape[0], n,
                   int(gate_up.dtype == torch.bfloat16), threads or torch.get_num_threads())
        return out

    def round_bf16(self, x: torch.Tensor, threads: int | None = None) -> torch.Tensor:
        """A contiguous fp32 tensor rounded to bf16 (nearest even), as x.to(torch.bfloat16)."""
        if x.dtype != torch.float32 or not x.is_contiguous() or x.device.type != "cpu":
            raise ValueError(f"x must be a contiguous fp32 CPU tensor, got {x.dtype} on {x.device}")
        out = torch.empty(x.shape, dtype=torch.bfloat16)
        self._round(x.data_ptr(), out.data_ptr(), x.numel(), threads or torch.get_num_threads())
        return out

    def entry_points(self) -> dict[str, int]:
        """The addresses of the add + RMSNorm, rotary, SiLU-and-multiply and bf16-rounding steps
        (for kernels/cpu_forward.c, which calls them from C)."""
        return {name: native.address(fn) for name, fn in
                (("norm", self._norm), ("rotary", self._rotary), ("silu", self._silu), ("round", self._round))}

    def masked_argmax(self, logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor | None = None,
                      logz: bool = False, threads: int | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Per row of `rows` (default: every row) of logits [N, V] and its int32 allow-mask
        (bitmask [N, >= ceil(V / 32)], bit t % 32 of word t // 32: token t allowed): the argmax
        over allowed tokens whose logit is neither NaN nor -inf (int64; lowest id on ties; -1
        where none), and when `logz` the log of the sum of e^logit over them (float32; -inf where
        none), else None."""
        _rows(logits, "logits")
        vocab = logits.shape[1]
        if bitmask.dtype != torch.int32 or bitmask.dim() != 2 or bitmask.stride(1) != 1:
            raise ValueError(f"bitmask must be 2-D int32 with a unit last stride, got {bitmask.dtype} "
                             f"{tuple(bitmask.shape)}")
        if bitmask.shape[0] < logits.shape[0] or bitmask.shape[1] * 32 < vocab:
            raise ValueError(f"bitmask {tuple(bitmask.shape)} does not cover logits {tuple(logits.shape)}")
        if rows is not None:
            rows = rows.to(torch.int64).contiguous()
            if rows.dim() != 1 or (rows.numel() and not 0 <= int(rows.min()) <= int(rows.max()) < logits.shape[0]):
                raise ValueError(f"rows must be 1-D indices into the {logits.shape[0]} rows of logits")
        n = logits.shape[0] if rows is None else rows.numel()
        idx = torch.empty(n, dtype=torch.int64)
        out = torch.empty(n, dtype=torch.float32) if logz else None
        if n:
            self._argmax(logits.data_ptr(), logits.stride(0), bitmask.data_ptr(), bitmask.stride(0),
                         None if rows is None else rows.data_ptr(), n, vocab, idx.data_ptr(),
                         None if out is None else out.data_ptr(), int(logits.dtype == torch.bfloat16),
                         threads or torch.get_num_threads())
        return idx, out


def load(cache_dir: Path | str | None = None) -> LayerOps:
    """The layer library, built on first use (RuntimeError: why not)."""
    return native.load(SOURCE, FLAGS, cache_dir, LayerOps)
