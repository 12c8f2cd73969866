"""Every decoder layer of a forward pass (bf16 or fp32) in one C call (kernels/cpu_forward.c).

The lean forward's fused path (structspec/engine/lean.py) calls eight C functions per layer
from Python: the fused elementwise steps (kernels/cpu_layer.py), the GEMMs through packed
weights (kernels/cpu_linear.py) and the attention (kernels/cpu_attention.py). This library
makes the same calls in the same order from C, taking the three libraries' entry points as
addresses, so a pass's layers cost one call from Python instead of ~240. Its results are
those of the per-call loop bit for bit (tests/kernels/test_cpu_forward.py).

A `Plan` holds what does not change between passes (entry points, sizes, every layer's weight
addresses); `ForwardLayers.run` takes one pass's rows. Built at first use by kernels/native.py
(``load`` raises ``RuntimeError`` saying why not).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from pathlib import Path

import torch

from structspec.kernels import native

__all__ = ["ForwardLayers", "LayerWeights", "Plan", "load"]

SOURCE = Path(__file__).with_name("cpu_forward.c")
FLAGS: tuple[str, ...] = ()


@dataclass(frozen=True)
class LayerWeights:
    """One decoder layer as cpu_forward.c reads it: the two RMSNorm weights ([hidden], of the
    model's dtype: bf16 or fp32) and epsilons, and the four GEMMs' packed weights
    (kernels.cpu_linear.PackedWeight, of the same dtype): q/k/v fused, o, gate/up fused, down."""
    norm1: torch.Tensor
    eps1: float
    qkv: object
    o: object
    norm2: torch.Tensor
    eps2: float
    gate_up: object
    down: object


@dataclass(frozen=True)
class Plan:
    """What ForwardLayers.run needs besides a pass's rows (ForwardLayers.plan builds it)."""
    fns: torch.Tensor      # int64 [6]: linear, norm, rotary, silu, round, attend
    sizes: torch.Tensor    # int64 [7]: layers, hidden, heads, kv_heads, head_dim, value_dim, intermediate
    weights: torch.Tensor  # int64 [layers, 10]: cpu_forward.c's W_* addresses
    eps: torch.Tensor      # fp32 [layers, 2]
    keep: tuple            # the tensors those addresses point into
    dtype: torch.dtype = torch.bfloat16  # the rows' and weights' (bf16 or fp32)


class ForwardLayers:
    """The compiled library (one per CPU and build flags; it does not depend on the model)."""

    def __init__(self, path: Path):
        self.path = path
        lib = native.open_library(path, SOURCE, "structspec_forward_version", 3)
        i64, ptr, c_int = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
        fn = lib.structspec_forward_layers
        fn.argtypes = [ptr, ptr, ptr, ptr, ptr, i64, ptr, ptr, i64, ptr, i64, c_int, c_int, ctypes.c_float, c_int,
                       ptr, i64, c_int]
        fn.restype = None
        self._fn = fn
        self._lib = lib

    def plan(self, linear, ops, attention, layers: list[LayerWeights], heads: int, kv_heads: int,
             intermediate: int) -> Plan:
        """A Plan over `layers` with kernels.cpu_linear's library `linear`, kernels.cpu_layer's
        `ops` and kernels.cpu_attention's `attention` (ValueError where the shapes or dtypes do
        not chain). The dtype is the first norm weight's: bf16 or fp32."""
        if not layers:
            raise ValueError("no layers")
        d, dv = attention.head_dim, attention.value_dim
        hidden, dtype = layers[0].norm1.shape[0], layers[0].norm1.dtype
        if dtype not in (torch.bfloat16, torch.float32):
            raise ValueError(f"the layer loop runs bf16 or fp32 models, not {dtype}")
        want = {"qkv": (hidden, (heads + kv_heads) * d + kv_heads * dv), "o": (heads * dv, hidden),
                "gate_up": (hidden, 2 * intermediate), "down": (intermediate, hidden)}
        rows, eps, keep = [], [], []
        for i, layer in enumerate(layers):
            for norm in (layer.norm1, layer.norm2):
                if norm.dtype != dtype or norm.shape != (hidden,) or not norm.is_contiguous():
                    raise ValueError(f"layer {i}: norm weights must be contiguous {dtype} [{hidden}]")
            row = [layer.norm1.data_ptr(), layer.norm2.data_ptr()]
            for name, shape in want.items():
                packed = getattr(layer, name)
                if (packed.in_features, packed.out_features) != shape:
                    raise ValueError(f"layer {i}: {name} is {packed.in_features} -> {packed.out_features}, the "
                                     f"model's sizes give {shape[0]} -> {shape[1]}")
                if packed.dtype != dtype:
                    raise ValueError(f"layer {i}: {name} is packed in {packed.dtype}, the norms are {dtype}")
                row += [packed.words.data_ptr(), 0 if packed.bias is None else packed.bias.data_ptr()]
                keep += [packed.words, packed.bias]
            rows.append(row)
            eps.append([layer.eps1, layer.eps2])
            keep += [layer.norm1, layer.norm2]
        weights = torch.tensor(rows, dtype=torch.int64)  # cpu_forward.c's W_* order
        points = ops.entry_points()
        fns = torch.tensor([linear.entry_point(dtype), points["norm"], points["rotary"], points["silu"], points["round"],
                            attention.entry_point()], dtype=torch.int64)
        sizes = torch.tensor([len(layers), hidden, heads, kv_heads, d, dv, intermediate], dtype=torch.int64)
        return Plan(fns, sizes, weights, torch.tensor(eps, dtype=torch.float32), tuple(keep), dtype)

    def run(self, plan: Plan, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, table: torch.Tensor,
            kv_dtype: torch.dtype, scale: float, out_rows: torch.Tensor | None = None,
            threads: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Every layer of `plan` over the rows x [T, hidden] (the plan's dtype, contiguous; the
        residual stream, updated in place), with rotary cos, sin [T, head_dim] (the same dtype,
        one row stride) and the attention's step table
        (kernels.cpu_attention.NativeAttention.attend's `table`, over KV buffers of `kv_dtype`:
        bf16 only for bf16 rows). Returns (the residual stream, y), each [R, hidden], of the rows
        `out_rows` (int64 indices into the T rows; None: all of them, R = T): the caller adds the
        two for those rows' output (as LeanForward._fused does). With out_rows, the last layer's o
        projection and MLP run over those rows alone (cpu_forward.c), with the same bits."""
        layers, hidden, heads, kv_heads, d, dv, inter = plan.sizes.tolist()
        dtype = plan.dtype
        if x.dtype != dtype or x.dim() != 2 or x.shape[1] != hidden or not x.is_contiguous():
            raise ValueError(f"x must be contiguous {dtype} [T, {hidden}], got {x.dtype} {tuple(x.shape)}")
        rows = x.shape[0]
        if out_rows is not None:
            if out_rows.dtype != torch.int64 or out_rows.dim() != 1 or not out_rows.is_contiguous():
                raise ValueError(f"out_rows must be a contiguous int64 vector, got {out_rows.dtype} "
                                 f"{tuple(out_rows.shape)}")
            if out_rows.numel():
                low, high = torch.aminmax(out_rows)
                if not 0 <= int(low) <= int(high) < rows:
                    raise ValueError(f"out_rows must index the {rows} rows")
        for t, name in ((cos, "cos"), (sin, "sin")):
            if t.dtype != dtype or t.shape != (rows, d) or t.stride(1) != 1:
                raise ValueError(f"{name} must be {dtype} [{rows}, {d}] with a unit last stride")
        if cos.stride(0) != sin.stride(0):
            raise ValueError("cos and sin must share a row stride")
        if table.dtype != torch.int64 or not table.is_contiguous() or table.shape[0] not in (2 * layers + 4,
                                                                                              4 * layers + 6):
            raise ValueError(f"table must be contiguous int64 [2 * layers + 4, S] or [4 * layers + 6, S], got "
                             f"{tuple(table.shape)}")
        if kv_dtype not in (torch.bfloat16, torch.float32) or (kv_dtype == torch.bfloat16 and dtype != kv_dtype):
            raise ValueError(f"KV buffers of {kv_dtype} for {dtype} rows: the attention takes fp32 KV, or bf16 KV "
                             f"with bf16 rows")
        fp32 = dtype == torch.float32
        like = dict(dtype=dtype)
        y = torch.empty(rows, hidden, **like)
        # the fp32 attention output, then its bf16 rounding (an fp32 model's o projection reads the former)
        attention = (torch.empty(rows, heads * dv, dtype=torch.float32), torch.empty(0 if fp32 else rows, heads * dv,
                                                                                      **like))
        kept = rows if out_rows is None else out_rows.numel()
        # the kept rows' residual stream and attention output (used only with out_rows)
        xo, atto = (torch.empty(0 if out_rows is None else kept, n, **like) for n in (hidden, heads * dv))
        scratch = (torch.empty(rows, hidden, **like), torch.empty(rows, (heads + kv_heads) * d + kv_heads * dv, **like),
                   *attention, torch.empty(rows, hidden, **like), torch.empty(rows, 2 * inter, **like),
                   torch.empty(rows, inter, **like), xo, atto)
        buffers = torch.tensor([x.data_ptr(), y.data_ptr(), *(t.data_ptr() for t in scratch)], dtype=torch.int64)
        if rows:
            self._fn(plan.fns.data_ptr(), plan.sizes.data_ptr(), plan.weights.data_ptr(), plan.eps.data_ptr(),
                     buffers.data_ptr(), rows, cos.data_ptr(), sin.data_ptr(), cos.stride(0), table.data_ptr(),
                     table.shape[1], int(table.shape[0] == 4 * layers + 6), int(kv_dtype == torch.bfloat16), scale,
                     int(fp32), None if out_rows is None else out_rows.data_ptr(), kept,
                     threads or torch.get_num_threads())
        return (x, y) if out_rows is None else (xo, y[:kept])


def load(cache_dir: Path | str | None = None) -> ForwardLayers:
    """The layer-loop library, built on first use (RuntimeError: why not)."""
    return native.load(SOURCE, FLAGS, cache_dir, ForwardLayers)
