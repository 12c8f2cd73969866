"""Linear layers on a CPU for a few rows, in C (kernels/cpu_linear.c): bf16 on CPUs with
AVX512-BF16, fp32 on CPUs with AVX-512F or with AVX2 and FMA.

A decode or verification pass multiplies a few rows by every weight matrix: its time is the
weight read plus the arithmetic that does not overlap it. oneDNN's prepacked GEMM (the engine's
other CPU path, structspec/engine/packed.py) overlaps them poorly; cpu_linear.c packs each
weight once into the order its loop streams it, prefetches ahead, and holds up to 8 (bf16) or 16
(fp32; 6 with AVX2) rows in registers against each loaded weight step (docs/kernels.md; figures in docs/benchmarks.md). On CPUs with
AMX, bf16 rows go through the tiles instead (16 rows by 48 columns a step of 32 inputs), for
every row count (``amx``): another fp32 sum order than the vector loop's, the same for a row
whatever the rows beside it.

* ``pack(weight, bias)``: the packed copy of a bf16 [n, k] weight (k even) or an fp32 one, and its bias;
* ``linear(x, packed)``: x [..., k] in the weight's dtype by it, [..., n] in that dtype;
* ``dtypes``: the weight dtypes this CPU's build serves;
* ``linear_pruned(x, packed, dense, wanted)``: ``linear``'s result where asked for and -inf
  elsewhere: every column of the rows marked ``dense``, only the ``GROUP_COLUMNS``-column groups
  marked ``wanted`` of the others (the logits a grammar allows, engine/packed.py). The loop
  computes whole groups of its packing (``group_columns(dtype)``: 48 columns in bf16), so a bf16
  row may get more than was asked for.

Each output is one fp32 chain over k in order, whatever the row count: a row's result does not
depend on the rows beside it. The order is not oneDNN's, so results differ from F.linear's in
the last bits of the fp32 sum (in bf16, one bf16 unit where the sum lies at a rounding
boundary). Built at first use by kernels/native.py; ``load`` raises ``RuntimeError`` saying why
not (no compiler, a CPU with neither AVX-512F nor AVX2 and FMA).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from pathlib import Path

import torch

from structspec.kernels import native

__all__ = ["GROUP_COLUMNS", "NativeLinear", "PackedWeight", "load"]

SOURCE = Path(__file__).with_name("cpu_linear.c")
FLAGS: tuple[str, ...] = ()
# each element type's (packed size, pack, linear, pruned linear) functions in the library
SYMBOLS = {"f32": ("structspec_linear_f32_packed_floats", "structspec_linear_f32_pack", "structspec_linear_f32",
                   "structspec_linear_f32_pruned"),
           "bf16": ("structspec_linear_packed_words", "structspec_linear_pack", "structspec_linear",
                    "structspec_linear_pruned")}
GROUP_COLUMNS = 16  # output columns an fp32 group packs together (cpu_linear.c: F32_GROUP)


@dataclass(frozen=True)
class PackedWeight:
    """A weight in cpu_linear.c's order: `words` [groups * k / 2 * GROUP] int32 (bf16 pairs) for a
    bf16 weight, [groups * k * GROUP] fp32 for an fp32 one; `bias` fp32 or None."""

    words: torch.Tensor
    bias: torch.Tensor | None
    out_features: int
    in_features: int

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of the weight packed (and of the rows it multiplies)."""
        return torch.float32 if self.words.dtype == torch.float32 else torch.bfloat16


class NativeLinear:
    """The compiled library (one per CPU and build flags; it does not depend on the model)."""

    def __init__(self, path: Path):
        self.path = path
        lib = native.open_library(path, SOURCE, "structspec_linear_version", 6)
        i64, ptr = ctypes.c_int64, ctypes.c_void_p
        lib.structspec_linear_types.restype = ctypes.c_int
        served = {torch.float32: "f32"} | ({torch.bfloat16: "bf16"} if lib.structspec_linear_types() & 2 else {})
        self.dtypes = frozenset(served)
        # bf16 rows on the AMX tiles (for weights whose k is a multiple of 32): an AMX build where
        # the OS allows the tiles
        self.amx = torch.bfloat16 in served and bool(lib.structspec_linear_amx())
        self._size, self._pack, self._run, self._pruned = {}, {}, {}, {}
        for dtype, name in served.items():  # the bf16 symbols exist only in an AVX512-BF16 build
            size, pack, run, pruned = (getattr(lib, symbol) for symbol in SYMBOLS[name])
            size.argtypes, size.restype = [i64, i64], i64
            pack.argtypes, pack.restype = [ptr, i64, i64, i64, ptr], None
            run.argtypes, run.restype = [ptr, i64, i64, i64, ptr, ptr, ptr, i64, i64, ctypes.c_int], None
            pruned.argtypes = [ptr, i64, i64, i64, ptr, ptr, ptr, i64, i64, ptr, ptr, ctypes.c_int]
            pruned.restype = None
            self._size[dtype], self._pack[dtype], self._run[dtype], self._pruned[dtype] = size, pack, run, pruned
        self._lib = lib

    def __deepcopy__(self, memo):  # a copied layer shares the process's library
        return self

    def __reduce__(self):
        return NativeLinear, (self.path,)

    def entry_point(self, dtype: torch.dtype = torch.bfloat16) -> int:
        """The address of the linear loop for `dtype` rows: structspec_linear (bf16) or
        structspec_linear_f32 (for kernels/cpu_forward.c, which calls it from C)."""
        if dtype not in self.dtypes:
            name = {torch.bfloat16: "bf16 (the CPU lacks AVX512-BF16)", torch.float32: "fp32"}.get(dtype, str(dtype))
            raise RuntimeError(f"this build of the linear kernel has no {name}")
        return native.address(self._run[dtype])

    def serves(self, weight: torch.Tensor) -> bool:
        """Whether `weight` (a layer's [n, k]) can run through this library."""
        return (weight.device.type == "cpu" and weight.dtype in self.dtypes
                and (weight.dtype != torch.bfloat16 or weight.shape[-1] % 2 == 0))

    def pack(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> PackedWeight:
        """`weight` [n, k] (bf16 with k even, or fp32; on the CPU) in the kernel's order; `bias` [n]
        kept in fp32."""
        names = " or ".join(sorted(str(t).removeprefix("torch.") for t in self.dtypes))
        if weight.dim() != 2 or weight.dtype not in self.dtypes or weight.device.type != "cpu":
            raise ValueError(f"weight must be a 2-D {names} CPU tensor, got {weight.dtype} {tuple(weight.shape)} "
                             f"on {weight.device}")
        n, k = weight.shape
        if k % 2 and weight.dtype == torch.bfloat16:
            raise ValueError(f"the bf16 kernel reads the inputs in pairs: in_features must be even, got {k}")
        if bias is not None and tuple(bias.shape) != (n,):
            raise ValueError(f"bias must have shape ({n},), got {tuple(bias.shape)}")
        w = weight.detach()
        if w.stride(1) != 1:
            w = w.contiguous()
        words = torch.empty(self._size[w.dtype](n, k), dtype=torch.int32 if w.dtype == torch.bfloat16 else w.dtype)
        self._pack[w.dtype](w.data_ptr(), w.stride(0), n, k, words.data_ptr())
        b = None if bias is None else bias.detach().to(torch.float32).contiguous()
        return PackedWeight(words, b, n, k)

    def linear(self, x: torch.Tensor, packed: PackedWeight, threads: int | None = None) -> torch.Tensor:
        """x [..., k] (on the CPU, in the packed weight's dtype) by `packed`: [..., n] in that dtype."""
        k, n, dtype = packed.in_features, packed.out_features, packed.dtype
        if x.dtype != dtype or x.device.type != "cpu" or x.shape[-1] != k:
            raise ValueError(f"x must be {str(dtype).removeprefix('torch.')} on the CPU with last dimension {k}, "
                             f"got {x.dtype} {tuple(x.shape)} on {x.device}")
        rows = _unit_rows(x.reshape(-1, k) if x.dim() != 2 else x, k)
        m = rows.shape[0]
        out = torch.empty(m, n, dtype=dtype)
        if m:
            self._run[dtype](rows.data_ptr(), rows.stride(0), m, k, packed.words.data_ptr(),
                             None if packed.bias is None else packed.bias.data_ptr(),
                             out.data_ptr(), n, n, threads or torch.get_num_threads())
        return out if x.dim() == 2 else out.view(*x.shape[:-1], n)

    def group_columns(self, dtype: torch.dtype) -> int:
        """Output columns one group of a `dtype` packing holds, which the loop computes whole
        (cpu_linear.c: GROUP in bf16, F32_GROUP in fp32), read from the library: a 1 x 2 weight
        packs into one group of one k step in bf16 (a pair), of two in fp32."""
        steps = 1 if dtype == torch.bfloat16 else 2
        return self._size[dtype](1, 2) // steps

    def linear_pruned(self, x: torch.Tensor, packed: PackedWeight, dense: torch.Tensor, wanted: torch.Tensor,
                      threads: int | None = None) -> torch.Tensor:
        """`linear(x, packed)` [m, n] where asked for, -inf elsewhere, for x [m, k] in the weight's
        dtype: row r gets every column where dense[r] (bool [m]), the others at least the
        GROUP_COLUMNS-column groups g with wanted[g] (bool [ceil(n / GROUP_COLUMNS)]): the whole
        group_columns(dtype)-column groups of the packing that hold them (in fp32 those exactly).
        The columns computed are `linear`'s bit for bit (the same chain over k)."""
        k, n, dtype = packed.in_features, packed.out_features, packed.dtype
        groups = -(-n // GROUP_COLUMNS)
        name = str(dtype).removeprefix("torch.")
        if x.dtype != dtype or x.device.type != "cpu" or x.dim() != 2 or x.shape[1] != k:
            raise ValueError(f"x must be {name} [m, {k}] on the CPU, got {x.dtype} {tuple(x.shape)} on {x.device}")
        m = x.shape[0]
        if tuple(dense.shape) != (m,) or dense.dtype != torch.bool:
            raise ValueError(f"dense must be bool [{m}], got {dense.dtype} {tuple(dense.shape)}")
        if tuple(wanted.shape) != (groups,) or wanted.dtype != torch.bool:
            raise ValueError(f"wanted must be bool [{groups}] (groups of {GROUP_COLUMNS} columns), "
                             f"got {wanted.dtype} {tuple(wanted.shape)}")
        rows = _unit_rows(x, k)
        dense, wanted = dense.contiguous(), wanted.contiguous()
        out = torch.empty(m, n, dtype=dtype)
        if m:
            self._pruned[dtype](rows.data_ptr(), rows.stride(0), m, k, packed.words.data_ptr(),
                                None if packed.bias is None else packed.bias.data_ptr(), out.data_ptr(), n, n,
                                dense.data_ptr(), wanted.data_ptr(), threads or torch.get_num_threads())
        return out


def _unit_rows(rows: torch.Tensor, k: int) -> torch.Tensor:
    """`rows` [m, k] as the C loop reads them: unit last stride, rows at least k apart (copied if not)."""
    if rows.stride(-1) != 1 or (rows.shape[0] > 1 and rows.stride(0) < k):
        return rows.contiguous()
    return rows


def load(cache_dir: Path | str | None = None) -> NativeLinear:
    """The linear library, built on first use (RuntimeError: why not)."""
    return native.load(SOURCE, FLAGS, cache_dir, NativeLinear)
