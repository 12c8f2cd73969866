"""Linear layers through prepacked weights on a CPU: oneDNN's, or kernels/cpu_linear.c's.

A decode or verification pass multiplies a few rows by every weight matrix, so its GEMMs
stream the weights from memory. torch's plain `F.linear` reads a row-major weight through
oneDNN's generic path; handing oneDNN the weight once in its own blocked layout
(`mkldnn._reorder_linear_weight`) and calling `mkldnn._linear_pointwise` with it skips the
per-call reorder and reads the blocks in order. This is what inductor's CPU `freezing` does;
here it needs no compiler and no warm-up. Measured in docs/benchmarks.md ("Packed linear
layers"). bf16 results are bit-identical to `F.linear`; fp32 results differ in the last bits
(another summation order), which the engine's near-tie tests cover.

On CPUs with AVX512-BF16, a bf16 engine under kernel_backend "auto" packs for
kernels/cpu_linear.c instead (`native_linear`; on CPUs with AMX its loop runs on the tiles), and
so does an fp32 engine on CPUs with AVX-512F or AVX2 and no bf16 units at all (where `auto` runs
fp32): oneDNN overlaps the weight read with the arithmetic poorly there, and the C loop streams
its own order with prefetches (docs/kernels.md; measured in docs/benchmarks.md, also against
oneDNN's AMX kernels). Its results differ from F.linear's in the last bits of the fp32 sum, as
fp32 oneDNN's do. fp32 on CPUs with bf16 units (run only where asked for) keeps oneDNN.

Pruned logits (`PackedLinear.forward_allowed`): a decoding row's grammar often allows a few
tokens (a key, punctuation, digits); where the native kernel runs the lm_head (fp32 or bf16),
such a row gets only the logits of the 16-token groups its grammar (and those of the step's other
such rows) allows (bf16: of the kernel's 48-token groups holding them), the rest -inf, which every
consumer masks anyway. The logits computed are the full GEMM's bit for bit, so the tokens chosen
do not change; a pass does the arithmetic of fewer rows.

The original weights stay where they are (the embedding may share one, and code reads their
shape and dtype): packing adds the size of the linear weights to memory.
"""

from __future__ import annotations

import functools
import logging

import torch
import torch.nn.functional as F
from torch import nn

from structspec.kernels.cpu_linear import GROUP_COLUMNS

log = logging.getLogger(__name__)

PACK_ROWS = 16  # the row count oneDNN is told to expect; measured rows 1-512 all gain or tie
# forward_allowed: a row is pruned when its grammar allows tokens in at most this share of the
# lm_head's column groups (the others need nearly every column: they run dense)
PRUNED_AT_MOST = 1 / 8


class PackedLinear(nn.Module):
    """`linear`'s weight and bias, its forward through a prepacked copy of the weight: for
    `native` (kernels.cpu_linear.NativeLinear) where given and the weight is bf16, else oneDNN's.
    The copy follows the weight: after `.to()`, a deepcopy or an in-place change it is packed
    again on the next call (or, off a CPU or in another dtype, the layer runs F.linear)."""

    def __init__(self, linear: nn.Linear, native=None):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias  # shared, not copied
        self.native = native
        self.packed = None  # oneDNN's opaque tensor, or the native kernel's PackedWeight
        self._packed_for: tuple = ()

    def _weight_key(self) -> tuple:
        w = self.weight
        try:
            version = w._version
        except RuntimeError:  # an inference tensor keeps no version counter
            version = None
        return (w.data_ptr(), w.dtype, w.device, version)

    def _repack(self) -> None:
        """Pack the weight again if it changed since it was packed (or was never packed)."""
        if self._packed_for != self._weight_key():
            w = self.weight.detach()
            self.packed = None
            if self.uses_native():
                self.packed = self.native.pack(w, self.bias)
            elif w.device.type == "cpu" and (w.dtype == torch.float32
                                             or (w.dtype == torch.bfloat16 and bf16_unpackable() is None)):
                self.packed = torch.ops.mkldnn._reorder_linear_weight(w, PACK_ROWS)
            self._packed_for = self._weight_key()

    def native_packed(self):
        """The weight as the native kernel reads it now (kernels.cpu_linear.PackedWeight; packed
        again first if the weight changed), or None when this layer does not run through it."""
        self._repack()
        return None if self.packed is None or isinstance(self.packed, torch.Tensor) else self.packed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._repack()
        if self.packed is None or x.dtype != self.weight.dtype:
            return F.linear(x, self.weight, self.bias)
        if not isinstance(self.packed, torch.Tensor):
            return self.native.linear(x, self.packed)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def forward_allowed(self, x: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
        """forward(x) [R, n] where `allowed` (int32 [R, words]: bit t % 32 of word t // 32 set
        when token t may follow, kernels/bitmask.py) allows, bit for bit; elsewhere the same or
        -inf (module docstring: pruned logits). Where the native kernel does not run this layer:
        forward(x)."""
        packed = self.native_packed()
        if packed is None or x.dtype != packed.dtype or x.dim() != 2:
            return self.forward(x)
        if allowed.dim() != 2 or allowed.shape[0] != x.shape[0] or allowed.dtype != torch.int32:
            raise ValueError(f"allowed must be int32 [{x.shape[0]}, words], got {allowed.dtype} {tuple(allowed.shape)}")
        groups = -(-self.out_features // GROUP_COLUMNS)
        # a group of 16 tokens is half a 32-bit word: the int16 halves, low half first (little-endian)
        need = allowed.contiguous().view(torch.int16)[:, :groups] != 0
        if need.shape[1] < groups:  # columns past the bitmask: never allowed
            need = torch.cat([need, need.new_zeros(need.shape[0], groups - need.shape[1])], dim=1)
        pruned = need.sum(1) <= int(groups * PRUNED_AT_MOST)
        if not bool(pruned.any()):
            return self.forward(x)
        return self.native.linear_pruned(x, packed, ~pruned, need[pruned].any(0))

    def uses_native(self) -> bool:
        """Whether the weight as it is now runs through the native kernel."""
        return self.native is not None and self.native.serves(self.weight)

    def __getstate__(self):  # deepcopy and pickle: oneDNN's opaque tensor cannot be copied; repacked on use
        return {**super().__getstate__(), "packed": None, "_packed_for": ()}

    def extra_repr(self) -> str:
        kind = "native" if self.uses_native() else "oneDNN"
        return f"in_features={self.in_features}, out_features={self.out_features}, prepacked ({kind})"


def can_pack(model: nn.Module, native=None) -> str | None:
    """None if `model`'s linear layers can be packed (for `native`, kernels.cpu_linear's library,
    where given); else why not."""
    param = next(model.parameters())
    if param.device.type != "cpu":
        return "not on a CPU"
    if native is not None and param.dtype == torch.bfloat16:
        return None
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


def native_linear(kernel_backend: str, model: nn.Module, cache_dir):
    """kernels/cpu_linear.c's library where it serves `model` (module docstring): kernel_backend
    "auto", on a CPU, bf16 weights where the CPU has AVX512-BF16 (with or without AMX), fp32 weights where
    it has no bf16 matrix units at all (AVX-512F, or AVX2 and FMA); else None (logged why, where it could apply)."""
    from structspec.engine.model import cpu_has_bf16_matmul

    param = next(model.parameters())
    if kernel_backend != "auto" or param.device.type != "cpu" or param.dtype not in (torch.bfloat16, torch.float32):
        return None
    if param.dtype == torch.float32 and cpu_has_bf16_matmul():
        return None  # fp32 only where asked for there (auto runs bf16): oneDNN's, not measured against the C loop
    try:
        from structspec.kernels.cpu_linear import load

        native = load(cache_dir)
    except Exception as e:  # no compiler, a CPU with neither AVX-512F nor AVX2: oneDNN's packing
        log.info("linear layers through oneDNN: the native linear kernel is unavailable (%s)", e)
        return None
    if param.dtype not in native.dtypes:
        log.info("bf16 linear layers through oneDNN: this CPU's build of the native linear kernel has no bf16 "
                 "(no AVX512-BF16)")
        return None
    return native


def pack_linears(model: nn.Module, native=None) -> int:
    """Swap every nn.Linear of `model` (on a CPU, fp32 or bf16) for a PackedLinear (for `native`,
    kernels.cpu_linear's library, where given) whose output was checked against F.linear on
    random rows; a layer that fails the check, or a model that cannot be packed, keeps its own.
    Returns the number of packed layers the model now has (those packed before included: an
    engine built on a model another engine packed; those are packed anew for `native`)."""
    why = can_pack(model, native)
    if why is not None:  # layers packed before (another engine, another dtype) become plain again
        log.info("linear layers not packed: %s", why)
        unpack_linears(model)
        return 0
    gen = torch.Generator().manual_seed(0)
    packed, kept = 0, []
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, PackedLinear) and child.native is not native:  # packed for the other kernel
                child = _plain(child)
            if type(child) is not nn.Linear:
                continue
            w = child.weight.detach()
            try:
                layer = PackedLinear(child, native)
                x = torch.randn(3, child.in_features, generator=gen).to(w.dtype)
                with torch.inference_mode():
                    got, want = layer(x).float(), F.linear(x, w, child.bias).float()
                # oneDNN's bf16 is F.linear's bit for bit; fp32 and the native kernel sum in another order
                tol = 1e-4 if w.dtype == torch.float32 else (2.0 ** -7 if layer.uses_native() else 0.0)
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
                setattr(parent, name, _plain(child))


def _plain(layer: PackedLinear) -> nn.Linear:
    """An nn.Linear with `layer`'s weight and bias (shared)."""
    plain = nn.Linear(layer.in_features, layer.out_features, bias=layer.bias is not None, device="meta")
    plain.weight, plain.bias = layer.weight, layer.bias
    return plain
