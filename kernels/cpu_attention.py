"""The ragged attention's decode/verification rows on a CPU, in one call per layer (C, OpenMP).

The torch path (structspec/engine/kv_cache.py) attends one sequence at a time: two writes and
one SDPA call per sequence and layer, ~100 us of operator overhead each on this project's CPU
against ~25 us to read the sequence's keys and values. cpu_attention.c takes the same step
table as the Triton kernels (kernels/attention.py) and does every listed sequence's append and
attention for one layer in a single call: K and V read once per (sequence, kv head) for all
its query heads and rows, fp32 arithmetic, the work split over torch's OpenMP threads.

It is built at first use for the model's head sizes and this CPU by kernels/native.py; ``load``
raises ``RuntimeError`` saying why when there is no compiler or the build fails, and the
engine keeps the torch path.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from structspec.kernels import native

__all__ = ["NativeAttention", "load"]

SOURCE = Path(__file__).with_name("cpu_attention.c")
FLAGS = ("-fassociative-math", "-fno-signed-zeros")


class NativeAttention:
    """The compiled library for one (head_dim, value_dim)."""

    def __init__(self, path: Path, head_dim: int, value_dim: int):
        self.path = path
        self.head_dim, self.value_dim = head_dim, value_dim
        lib = native.open_library(path, SOURCE, "structspec_attend_version", 2)
        if lib.structspec_attend_dims() != head_dim * 10000 + value_dim:
            raise RuntimeError(f"{path} was built for other head sizes")
        # q.K on the matrix units (AMX; bf16 queries and KV) where this CPU has them and the OS allows it
        self.amx = bool(lib.structspec_attend_amx())
        # P.V of bf16 KV with the probabilities rounded to bf16 (vdpbf16ps; CPUs with AVX512-BF16),
        # as the GPU kernel's; fp32 probabilities elsewhere (and in builds of older sources, which
        # lack the function: bench.attention --against times them)
        self.p_bf16 = hasattr(lib, "structspec_attend_p_bf16") and bool(lib.structspec_attend_p_bf16())
        fn = lib.structspec_attend
        i64, ptr = ctypes.c_int64, ctypes.c_void_p
        fn.argtypes = [ptr, i64, i64, ptr, i64, i64, ptr, i64, i64, ctypes.c_int, ctypes.c_int, ptr, i64, i64, ptr,
                       i64, i64, i64, ctypes.c_int, ctypes.c_int, ctypes.c_float, i64, ctypes.c_int, ctypes.c_int]
        fn.restype = None
        self._fn = fn
        self._lib = lib

    def entry_point(self) -> int:
        """The address of structspec_attend (for kernels/cpu_forward.c, which calls it from C)."""
        return native.address(self._fn)

    def attend(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, out: torch.Tensor,
               table: torch.Tensor, layers: int, layer: int, scale: float, window: int | None = None,
               kv_dtype: torch.dtype = torch.float32, threads: int | None = None, check: bool = True) -> None:
        """Append and attend, for `layer`, every sequence of `table` (int64 [2 * layers + 4, S] on
        the CPU, the layout of kv_cache.Step.tables; buffers [kv_heads, capacity, dim] of
        `kv_dtype`: fp32, or bf16 with bf16 inputs), or [4 * layers + 6, S] with each sequence's
        shared prefix entry after it (kv_cache.native_table; cpu_attention.c's header).
        query [T, heads, D], key [T, kv_heads, D], value [T, kv_heads, DV]: fp32 or bf16, one
        dtype, unit last stride; writes rows of `out` [T, heads, DV] fp32 contiguous. The caller
        keeps the buffers alive and large enough (the engine's slots do). check=False skips the
        argument checks, for a caller that passes the shapes it passed before (the rest of a
        forward pass's layers)."""
        if check:
            if not (query.dtype == key.dtype == value.dtype) or query.dtype not in (torch.float32, torch.bfloat16):
                raise ValueError(f"query, key and value must share fp32 or bf16, got {query.dtype}, {key.dtype}, "
                                 f"{value.dtype}")
            if kv_dtype not in (torch.float32, query.dtype):
                raise ValueError(f"KV buffers of {kv_dtype} take {kv_dtype} rows, not {query.dtype}")
            if query.shape[2] != self.head_dim or key.shape[2] != self.head_dim or value.shape[2] != self.value_dim:
                raise ValueError(f"head sizes {query.shape[2]}/{value.shape[2]}, built for {self.head_dim}/"
                                 f"{self.value_dim}")
            if query.shape[1] % key.shape[1] or key.shape[1] != value.shape[1]:
                raise ValueError(f"{query.shape[1]} query heads over {key.shape[1]} key / {value.shape[1]} value heads")
            if any(t.stride(2) != 1 for t in (query, key, value)):
                raise ValueError("query, key and value need a unit last stride")
            if out.dtype != torch.float32 or not out.is_contiguous() or out.shape != (query.shape[0], query.shape[1],
                                                                                     self.value_dim):
                raise ValueError("out must be contiguous fp32 [T, heads, DV]")
            if table.dtype != torch.int64 or not table.is_contiguous() or table.shape[0] not in (2 * layers + 4,
                                                                                                  4 * layers + 6):
                raise ValueError(f"table must be contiguous int64 [2 * layers + 4, S] or [4 * layers + 6, S], got "
                                 f"{tuple(table.shape)}")
        self._fn(query.data_ptr(), query.stride(0), query.stride(1), key.data_ptr(), key.stride(0), key.stride(1),
                 value.data_ptr(), value.stride(0), value.stride(1), int(query.dtype == torch.bfloat16),
                 int(kv_dtype == torch.bfloat16), out.data_ptr(), out.stride(0), out.stride(1), table.data_ptr(), table.shape[1], layers, layer,
                 query.shape[1], key.shape[1], scale, window or 0, int(table.shape[0] == 4 * layers + 6),
                 threads or torch.get_num_threads())


def load(head_dim: int, value_dim: int, cache_dir: Path | str | None = None) -> NativeAttention:
    """The attention library for these head sizes, built on first use (RuntimeError: why not)."""
    return native.load(SOURCE, FLAGS + (f"-DHEAD_DIM={head_dim}", f"-DVALUE_DIM={value_dim}"), cache_dir,
                       lambda path: NativeAttention(path, head_dim, value_dim))
