"""bf16 linear layers on a CPU with AVX512-BF16, in C (kernels/cpu_linear.c).

A decode or verification pass multiplies a few rows by every weight matrix: its time is the
weight read plus the arithmetic that does not overlap it. oneDNN's prepacked bf16 GEMM (the
engine's other CPU path, structspec/engine/packed.py) overlaps them poorly on CPUs without AMX;
cpu_linear.c packs each weight once into the order its loop streams it, prefetches ahead, and
holds up to eight rows in registers against each loaded weight pair (docs/kernels.md; figures in
docs/benchmarks.md).

* ``pack(weight, bias)``: the packed copy of a bf16 [n, k] weight (k even) and its bias;
* ``linear(x, packed)``: x [..., k] bf16 by it, [..., n] bf16.

Each output is one fp32 chain over the k pairs in order, whatever the row count: a row's result
does not depend on the rows beside it. The order is not oneDNN's, so results differ from
F.linear's in the last bits of the fp32 sum (one bf16 unit where the sum lies at a rounding
boundary). Built at first use by kernels/native.py; ``load`` raises ``RuntimeError`` saying why
not (no compiler, a CPU without AVX512-BF16).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from pathlib import Path

import torch

from kernels import native

__all__ = ["NativeLinear", "PackedWeight", "load"]

SOURCE = Path(__file__).with_name("cpu_linear.c")
FLAGS: tuple[str, ...] = ()


@dataclass(frozen=True)
class PackedWeight:
    """A weight in cpu_linear.c's order: `words` int32 [groups * k / 2 * GROUP], `bias` fp32 or None."""

    words: torch.Tensor
    bias: torch.Tensor | None
    out_features: int
    in_features: int


class NativeLinear:
    """The compiled library (one per CPU and build flags; it does not depend on the model)."""

    def __init__(self, path: Path):
        self.path = path
        lib = native.open_library(path, SOURCE, "structspec_linear_version", 1)
        i64, ptr = ctypes.c_int64, ctypes.c_void_p
        lib.structspec_linear_packed_words.argtypes = [i64, i64]
        lib.structspec_linear_packed_words.restype = i64
        lib.structspec_linear_pack.argtypes = [ptr, i64, i64, i64, ptr]
        lib.structspec_linear_pack.restype = None
        lib.structspec_linear.argtypes = [ptr, i64, i64, i64, ptr, ptr, ptr, i64, i64, ctypes.c_int]
        lib.structspec_linear.restype = None
        self._lib = lib

    def __deepcopy__(self, memo):  # a copied layer shares the process's library
        return self

    def __reduce__(self):
        return NativeLinear, (self.path,)

    def entry_point(self) -> int:
        """The address of structspec_linear (for kernels/cpu_forward.c, which calls it from C)."""
        return native.address(self._lib.structspec_linear)

    def pack(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> PackedWeight:
        """`weight` [n, k] (bf16, on the CPU, k even) in the kernel's order; `bias` [n] kept in fp32."""
        if weight.dim() != 2 or weight.dtype != torch.bfloat16 or weight.device.type != "cpu":
            raise ValueError(f"weight must be a 2-D bf16 CPU tensor, got {weight.dtype} {tuple(weight.shape)} "
                             f"on {weight.device}")
        n, k = weight.shape
        if k % 2:
            raise ValueError(f"the kernel reads the inputs in pairs: in_features must be even, got {k}")
        if bias is not None and tuple(bias.shape) != (n,):
            raise ValueError(f"bias must have shape ({n},), got {tuple(bias.shape)}")
        w = weight.detach()
        if w.stride(1) != 1:
            w = w.contiguous()
        words = torch.empty(self._lib.structspec_linear_packed_words(n, k), dtype=torch.int32)
        self._lib.structspec_linear_pack(w.data_ptr(), w.stride(0), n, k, words.data_ptr())
        b = None if bias is None else bias.detach().to(torch.float32).contiguous()
        return PackedWeight(words, b, n, k)

    def linear(self, x: torch.Tensor, packed: PackedWeight, threads: int | None = None) -> torch.Tensor:
        """x [..., k] (bf16, on the CPU) by `packed`: [..., n] bf16."""
        k, n = packed.in_features, packed.out_features
        if x.dtype != torch.bfloat16 or x.device.type != "cpu" or x.shape[-1] != k:
            raise ValueError(f"x must be bf16 on the CPU with last dimension {k}, got {x.dtype} "
                             f"{tuple(x.shape)} on {x.device}")
        rows = x.reshape(-1, k) if x.dim() != 2 else x
        if rows.stride(-1) != 1 or (rows.shape[0] > 1 and rows.stride(0) < k):
            rows = rows.contiguous()
        m = rows.shape[0]
        out = torch.empty(m, n, dtype=torch.bfloat16)
        if m:
            self._lib.structspec_linear(rows.data_ptr(), rows.stride(0), m, k, packed.words.data_ptr(),
                                        None if packed.bias is None else packed.bias.data_ptr(),
                                        out.data_ptr(), n, n, threads or torch.get_num_threads())
        return out if x.dim() == 2 else out.view(*x.shape[:-1], n)


def load(cache_dir: Path | str | None = None) -> NativeLinear:
    """The linear library, built on first use (RuntimeError: why not)."""
    return native.load(SOURCE, FLAGS, cache_dir, NativeLinear)
