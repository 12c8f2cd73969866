"""Linear layers through oneDNN's prepacked weights on a CPU.

A decode or verification pass multiplies a few rows by every weight matrix, so its GEMMs
stream the weights from memory. torch's plain `F.linear` reads a row-major weight through
oneDNN's generic path; handing oneDNN the weight once in its own blocked layout
(`mkldnn._reorder_linear_weight`) and calling `mkldnn._linear_pointwise` with it skips the
per-call reorder and reads the blocks in order. This is what inductor's CPU `freezing` does;
here it needs no compiler and no warm-up. Measured in docs/benchmarks.md ("Packed linear
layers"). bf16 results are bit-identical to `F.linear`; fp32 results differ in the last bits
(another summation order), which the engine's near-tie tests cover.

The original weights stay where they are (the embedding may share one, and code reads their
shape and dtype): packing adds the size of the linear weights to memory.
"""

from __future__ import annotations

import functools
import logging

import torch
import torch.nn.functional as F
from torch import nn

log = logging.getLogger(__name__)

PACK_ROWS = 16  # the row count oneDNN is told to expect; measured rows 1-512 all gain or tie


class PackedLinear(nn.Module):
    """`linear`'s weight and bias, its forward through a prepacked copy of the weight. The copy
    follows the weight: after `.to()`, a deepcopy or an in-place change it is packed again on
    the next call (or, off a CPU or in another dtype, the layer runs F.linear)."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias  # shared, not copied
        self.packed: torch.Tensor | None = None
        self._packed_for: tuple = ()

    def _weight_key(self) -> tuple:
        w = self.weight
        try:
            version = w._version
        except RuntimeError:  # an inference tensor keeps no version counter
            version = None
        return (w.data_ptr(), w.dtype, w.device, version)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._packed_for != self._weight_key():
            w = self.weight.detach()
            packable = w.device.type == "cpu" and (w.dtype == torch.float32
                                                   or (w.dtype == torch.bfloat16 and bf16_unpackable() is None))
            self.packed = torch.ops.mkldnn._reorder_linear_weight(w, PACK_ROWS) if packable else None
            self._packed_for = self._weight_key()
        if self.packed is None or x.dtype != self.weight.dtype:
            return F.linear(x, self.weight, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def __getstate__(self):  # deepcopy and pickle: oneDNN's opaque tensor cannot be copied; repacked on use
        return {**super().__getstate__(), "packed": None, "_packed_for": ()}

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, prepacked"


def can_pack(model: nn.Module) -> str | None:
    """None if `model`'s linear layers can be packed; else why not."""
    param = next(model.parameters())
    if param.device.type != "cpu":
        return "not on a CPU"
    if not torch.backends.mkldnn.is_available():
        return "torch was built without oneDNN"
    if param.dtype not in (torch.float32, torch.bfloat16):
        return f"dtype {param.dtype} (oneDNN packs fp32 and bf16)"
    if param.dtype == torch.bfloat16:
        return bf16_unpackable()
    return None


@functools.cache
def bf16_unpackable() -> str | None:
    """None if oneDNN packs bf16 weights on this CPU, else why not: it needs AVX512 (BW, VL, DQ)
    or AVX-NE-CONVERT, which AVX2-only CPUs lack (there bf16 runs through F.linear). Probed once."""
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(16, 16, dtype=torch.bfloat16), PACK_ROWS)
    except RuntimeError as e:
        return f"oneDNN cannot pack bf16 weights on this CPU ({' '.join(str(e).split())[:160]})"
    return None


def pack_linears(model: nn.Module) -> int:
    """Swap every nn.Linear of `model` (on a CPU, fp32 or bf16) for a PackedLinear whose output
    was checked against F.linear on random rows; a layer that fails the check, or a model that
    cannot be packed, keeps its own. Returns the number of packed layers the model now has
    (those packed before included: an engine built on a model another engine packed)."""
    why = can_pack(model)
    if why is not None:  # layers packed before (another engine, another dtype) become plain again
        log.info("linear layers not packed: %s", why)
        unpack_linears(model)
        return 0
    gen = torch.Generator().manual_seed(0)
    packed, kept = 0, []
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is not nn.Linear:
                continue
            w = child.weight.detach()
            try:
                layer = PackedLinear(child)
                x = torch.randn(3, child.in_features, generator=gen).to(w.dtype)
                with torch.inference_mode():
                    got, want = layer(x).float(), F.linear(x, w, child.bias).float()
                tol = 1e-4 if w.dtype == torch.float32 else 0.0
                if not (got - want).abs().max() <= tol * want.abs().max().clamp_min(1.0):
                    raise ValueError(f"output differs from F.linear by {(got - want).abs().max():.3g}")
            except Exception as e:  # noqa: BLE001 - any failure keeps the plain layer
                kept.append(f"{name}: {type(e).__name__}: {e}")
                continue
            setattr(parent, name, layer)
            packed += 1
    if kept:
        log.warning("%d linear layer(s) kept unpacked: %s", len(kept), "; ".join(kept[:3]))
    return sum(isinstance(m, PackedLinear) for m in model.modules())


def unpack_linears(model: nn.Module) -> None:
    """Undo pack_linears: every PackedLinear back to an nn.Linear with the same weight and bias."""
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, PackedLinear):
                plain = nn.Linear(child.in_features, child.out_features, bias=child.bias is not None,
                                  device="meta")
                plain.weight, plain.bias = child.weight, child.bias
                setattr(parent, name, plain)
