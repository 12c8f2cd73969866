"""A lean forward pass for Llama-shaped decoder models: the same arithmetic as transformers',
in about half the operator calls.

A decode or verification pass over a few rows is launch-bound on a CPU: each of the model's
~60 operator calls per layer costs microseconds of dispatch whatever its size (issue 31's
profile). This forward runs the model's own weights with fewer calls: q, k and v projected by
one GEMM over their concatenated weights, gate and up by another, rotary embeddings applied to
queries and keys together, the layer loop in one function rather than through nested modules.
Attention is structspec's ragged attention (kv_cache.py), called as the model's own modules
call it. The arithmetic is transformers' Llama code step by step (RMSNorm in fp32 rounded back
before its weight, rotary in the model's dtype), so in bf16 the logits are bit-identical to the
model's own forward through the same attention; in fp32 the fused GEMMs sum in another order
(last bits). runner.with_lean checks it against the model's own forward at start-up and keeps
the model's forward when it differs.

On a CPU, with the native attention, the steps between the GEMMs (residual add + RMSNorm,
rotary, SiLU x up) run fused in C (kernels/cpu_layer.c: one call and one pass each instead of
~20 operators a layer); rotary and the adds round exactly as torch does, RMSNorm and SiLU
within the last bits of fp32, so the check against the model's own forward holds within its
tolerance rather than bit for bit. Where, in addition, every GEMM runs through
kernels/cpu_linear.c (bf16 on CPUs with AVX512-BF16, on the AMX tiles where there are any; fp32 where `auto` runs fp32 on a
CPU with AVX-512F, or AVX2 and FMA), the loop over the layers
itself runs in C (kernels/cpu_forward.c: the same calls, the same bits, one call from Python
a pass instead of ~240).

Served: decoder layers shaped like transformers' LlamaDecoderLayer (q/k/v/o projections, a
gated SiLU MLP, RMSNorm before attention and MLP, rotary from the model's `rotary_emb`), with
or without biases on any projection, no per-head q/k norms, no sliding window. Anything else: the
model's own forward. The concatenated weights replace the projections' own (these become
views into them), so memory does not grow.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from structspec.engine.kv_cache import CURRENT, Step, native_attention_rows, ragged_attention
from structspec.engine.packed import PackedLinear, can_pack, pack_linears, unpack_linears

ATTENTION_PARTS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_PARTS = ("gate_proj", "up_proj", "down_proj")
LINEAR = (nn.Linear, PackedLinear)


def unsupported(model) -> str | None:
    """None if `model` can run the lean forward; else why not."""
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if inner is None or layers is None or not len(layers):
        return "no decoder layers at model.model.layers"
    for name in ("embed_tokens", "norm", "rotary_emb"):
        if not hasattr(inner, name):
            return f"no model.model.{name}"
    if getattr(model, "lm_head", None) is None:
        return "no lm_head"
    cfg = model.config
    if getattr(cfg, "hidden_act", None) != "silu":
        return f"activation {getattr(cfg, 'hidden_act', None)!r} (the lean forward has SiLU)"
    if getattr(cfg, "pretraining_tp", 1) not in (None, 1):
        return "tensor-parallel slicing (pretraining_tp > 1)"
    for layer in layers:
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        if attn is None or mlp is None:
            return "a layer without self_attn and mlp"
        if not all(isinstance(getattr(attn, p, None), LINEAR) for p in ATTENTION_PARTS):
            return "attention projections other than q/k/v/o linear layers"
        if not all(isinstance(getattr(mlp, p, None), LINEAR) for p in MLP_PARTS):
            return "an MLP other than gate/up/down linear layers"
        for extra in ("q_norm", "k_norm", "sinks"):
            if getattr(attn, extra, None) is not None:
                return f"attention with {extra}"
        if getattr(attn, "sliding_window", None) is not None:
            return "sliding-window attention"
        for norm in ("input_layernorm", "post_attention_layernorm"):
            n = getattr(layer, norm, None)
            if n is None or not hasattr(n, "variance_epsilon") or getattr(n, "weight", None) is None:
                return f"no RMSNorm {norm}"
        if set(name for name, _ in layer.named_children()) - {"self_attn", "mlp", "input_layernorm",
                                                               "post_attention_layernorm"}:
            return "layers with modules beyond attention, MLP and two norms"
    return None


def _fuse(parts: list[nn.Linear]) -> nn.Linear:
    """One linear layer over `parts`' concatenated weights (and biases); each part's weight and
    bias become views into it, so the model's own forward keeps working on the same memory."""
    weight = torch.cat([p.weight.detach() for p in parts])
    has_bias = [p.bias is not None for p in parts]
    bias = None
    if any(has_bias):
        bias = torch.cat([p.bias.detach() if p.bias is not None else
                          torch.zeros(p.out_features, dtype=weight.dtype, device=weight.device) for p in parts])
    fused = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta")
    fused.weight = nn.Parameter(weight, requires_grad=False)
    if bias is not None:
        fused.bias = nn.Parameter(bias, requires_grad=False)
    at = 0
    for p, with_bias in zip(parts, has_bias):
        n = p.out_features
        p.weight = nn.Parameter(weight[at:at + n], requires_grad=False)
        if with_bias:
            p.bias = nn.Parameter(fused.bias[at:at + n], requires_grad=False)
        at += n
    return fused


class LeanLayer:
    """One decoder layer's weights as the lean forward reads them. The layer's own projections
    are left plain (any packed copy of theirs freed) and their weights made views of the fused
    ones; the lean forward packs its own (engine/packed.py) when `pack`."""

    def __init__(self, layer, pack: bool, linear=None):
        unpack_linears(layer)
        attn, mlp = layer.self_attn, layer.mlp
        wrap = (lambda plain: PackedLinear(plain, linear)) if pack else (lambda plain: plain)
        self.attn = attn
        self.index = attn.layer_idx
        self.qkv = wrap(_fuse([attn.q_proj, attn.k_proj, attn.v_proj]))
        self.o = wrap(attn.o_proj)
        self.gate_up = wrap(_fuse([mlp.gate_proj, mlp.up_proj]))
        self.down = wrap(mlp.down_proj)
        self.norm1, self.eps1 = layer.input_layernorm.weight, layer.input_layernorm.variance_epsilon
        self.norm2, self.eps2 = layer.post_attention_layernorm.weight, layer.post_attention_layernorm.variance_epsilon
        self.intermediate = mlp.gate_proj.out_features


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' LlamaRMSNorm, bit for bit: normalised in fp32, rounded to x's dtype, then
    scaled by the weight in that dtype."""
    if x.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    return weight * F.rms_norm(x.float(), (x.shape[-1],), None, eps).to(x.dtype)


class LeanForward:
    """`model`'s forward for packed rows, in fewer operator calls (module docstring). Build with
    `build()`, which says why a model cannot run it."""

    def __init__(self, model, pack: bool, ops=None, linear=None, layer_loop=None):
        inner = model.model
        cfg = model.config
        self.model = model
        self.embed = inner.embed_tokens
        self.rotary = inner.rotary_emb
        self.norm, self.eps = inner.norm.weight, inner.norm.variance_epsilon
        self.lm_head = model.lm_head
        first = inner.layers[0].self_attn
        self.heads = cfg.num_attention_heads
        self.kv_heads = getattr(cfg, "num_key_value_heads", None) or self.heads
        self.head_dim = first.head_dim
        self.scaling = first.scaling
        self.layers = [LeanLayer(layer, pack, linear) for layer in inner.layers]
        self.packed = pack
        self.linear = linear  # kernels.cpu_linear's library for the packed layers; None: oneDNN
        self.ops = ops  # kernels.cpu_layer.LayerOps: the elementwise steps fused in C; None: eager torch
        # kernels.cpu_forward.ForwardLayers: with ops, the native attention and every GEMM through
        # `linear`, a pass's whole layer loop in one C call; None: the loop in Python
        in_order = [layer.index for layer in self.layers] == list(range(len(self.layers)))
        self.layer_loop = layer_loop if in_order else None
        self._plan, self._plan_for = None, ()
        self._gemms = self.linear_modules()[:-1]  # the layers' four GEMMs each, in order (lm_head is last)

    @classmethod
    def build(cls, model, pack: bool, ops=None, linear=None, layer_loop=None) -> tuple["LeanForward | None", str]:
        """(the lean forward, "") or (None, why not); `ops` and `layer_loop` as LeanForward's;
        `linear`: kernels.cpu_linear's library for the packed layers (engine/packed.py), where given."""
        why = unsupported(model)
        if why is not None:
            return None, why
        pack = pack and can_pack(model, linear) is None
        return cls(model, pack, ops, linear if pack else None, layer_loop), ""

    def linear_modules(self) -> list:
        """The linear modules this forward runs: each fused layer's qkv, o, gate_up and down, and
        the lm_head."""
        return [m for layer in self.layers for m in (layer.qkv, layer.o, layer.gate_up, layer.down)] + [self.lm_head]

    def packed_linears(self) -> int:
        """Linear layers this forward runs through prepacked weights (the fused ones count once)."""
        return sum(isinstance(m, PackedLinear) for m in self.linear_modules())

    def release(self) -> None:
        """Give the model's layers back to its own forward: their projections packed again where
        the lean forward had taken their packing over (their weights stay views of the fused)."""
        if self.packed:
            for layer in self.model.model.layers:
                pack_linears(layer, self.linear)

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, logits_rows: torch.Tensor,
                 allowed: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [R, V] of `logits_rows` of the packed rows (input_ids, positions: [T]); the
        attention reads the step set in kv_cache.CURRENT. `allowed`: each logits row's grammar
        bitmask (runner.StepInputs), where the lm_head may leave what it forbids at -inf."""
        if self.ops is not None:
            return self._fused(input_ids, positions, logits_rows, allowed)
        x = self.embed(input_ids)
        rows = x.shape[0]
        cos, sin = self.rotary(x, positions.unsqueeze(0))
        cos, sin = cos[0].unsqueeze(1), sin[0].unsqueeze(1)  # [T, 1, D], x's dtype
        h, kvh, d = self.heads, self.kv_heads, self.head_dim
        half, qk_width = d // 2, (h + kvh) * d
        last_layer, kept = self.layers[-1], _kept_rows(logits_rows, rows)
        for layer in self.layers:
            qkv = layer.qkv(rms_norm(x, layer.norm1, layer.eps1))
            qk = qkv[:, :qk_width].view(rows, h + kvh, d)
            qk = qk * cos + torch.cat((-qk[..., half:], qk[..., :half]), dim=-1) * sin
            query = qk[:, :h].transpose(0, 1).unsqueeze(0)
            key = qk[:, h:].transpose(0, 1).unsqueeze(0)
            value = qkv[:, qk_width:].view(rows, kvh, -1).transpose(0, 1).unsqueeze(0)
            out, _ = ragged_attention(layer.attn, query, key, value, None, scaling=self.scaling)
            out = out.reshape(rows, -1)
            if layer is last_layer and kept is not None:
                x, out = x[kept], out[kept]
            x = x + layer.o(out)
            gate_up = layer.gate_up(rms_norm(x, layer.norm2, layer.eps2))
            x = x + layer.down(F.silu(gate_up[:, :layer.intermediate]) * gate_up[:, layer.intermediate:])
        return self._head(rms_norm(x, self.norm, self.eps), allowed)

    def _head(self, h: torch.Tensor, allowed: torch.Tensor | None) -> torch.Tensor:
        """The lm_head over the final rows: pruned to what `allowed` allows where it can be
        (packed.PackedLinear.forward_allowed)."""
        if allowed is not None and isinstance(self.lm_head, PackedLinear):
            return self.lm_head.forward_allowed(h, allowed)
        return self.lm_head(h)

    def _fused(self, input_ids: torch.Tensor, positions: torch.Tensor, logits_rows: torch.Tensor,
               allowed: torch.Tensor | None = None) -> torch.Tensor:
        """__call__ with the elementwise steps in C (self.ops): the residual stream x is updated
        in place, rotary is applied in place to the q/k columns of the qkv GEMM's output."""
        ops = self.ops
        x = self.embed(input_ids)
        rows = x.shape[0]
        cos, sin = self.rotary(x, positions.unsqueeze(0))
        cos, sin = cos[0], sin[0]  # [T, D], x's dtype
        h, kvh, d = self.heads, self.kv_heads, self.head_dim
        q_width, qk_width = h * d, (h + kvh) * d
        step = CURRENT.get()
        native = isinstance(step, Step) and step.attention == "native"
        plan = self._layer_plan(step.native) if native else None
        kept = _kept_rows(logits_rows, rows)
        if plan is not None:  # the same calls as the loop below, made from C
            xs, ys = self.layer_loop.run(plan, x, cos, sin, step.native_table(), step.segments[0].slot.keys[0].dtype,
                                         self.scaling, kept)
            return self._head(ops.add_rms_norm(xs + ys, None, self.norm, self.eps), allowed)
        y = None  # the last sublayer's output, not yet added to x
        last_layer = self.layers[-1]
        for layer in self.layers:
            check = layer is self.layers[0]  # the C steps' argument checks: the same shapes every layer
            qkv = layer.qkv(ops.add_rms_norm(x, y, layer.norm1, layer.eps1, check=check))
            ops.rotary_(qkv, cos, sin, h + kvh, d, check=check)
            if native:  # straight from the qkv rows to the C attention, without the attention interface
                out = native_attention_rows(step, layer.index, qkv[:, :q_width].view(rows, h, d),
                                            qkv[:, q_width:qk_width].view(rows, kvh, d),
                                            qkv[:, qk_width:].view(rows, kvh, -1), None, self.scaling, check)
            else:
                query = qkv[:, :q_width].view(rows, h, d).transpose(0, 1).unsqueeze(0)
                key = qkv[:, q_width:qk_width].view(rows, kvh, d).transpose(0, 1).unsqueeze(0)
                value = qkv[:, qk_width:].view(rows, kvh, -1).transpose(0, 1).unsqueeze(0)
                out, _ = ragged_attention(layer.attn, query, key, value, None, scaling=self.scaling)
            out = out.reshape(rows, -1)
            if layer is last_layer and kept is not None:
                x, out = x[kept], out[kept]
            hidden = ops.add_rms_norm(x, layer.o(out), layer.norm2, layer.eps2, check=check)
            y = layer.down(ops.silu_mul(layer.gate_up(hidden), check=check))
        return self._head(ops.add_rms_norm(x + y, None, self.norm, self.eps), allowed)

    def loops_natively(self) -> bool:
        """Whether a pass with the native attention runs its layer loop in C: the loop library is
        there, with the fused steps, and every layer's GEMMs run through the native kernel (bf16
        or fp32, all in the model's dtype)."""
        return self.layer_loop is not None and self.ops is not None and all(
            isinstance(m, PackedLinear) and m.uses_native() and m.weight.dtype == self.norm.dtype for m in self._gemms)

    def _layer_plan(self, attention):
        """The layer loop's plan (kernels.cpu_forward.Plan) for `attention` (the step's
        kernels.cpu_attention.NativeAttention), kept while the libraries and every GEMM's weight
        stay the same; None without a layer loop or where a GEMM does not run through the native
        kernel."""
        if self.layer_loop is None:
            return None
        gemms = self._gemms
        # the plan stands while the three libraries and every GEMM's weight tensor and its version
        # do (read from _parameters: nn.Module's attribute lookup costs more than the rest of the check)
        weights = [m._parameters["weight"] for m in gemms]
        stamp = (attention, self.ops, self.linear, *zip(weights, map(_version, weights)))
        was = self._plan_for
        if self._plan is not None and len(stamp) == len(was) and all(a is b for a, b in zip(stamp[:3], was)) and all(
                w is w_was and v == v_was for (w, v), (w_was, v_was) in zip(stamp[3:], was[3:])):
            return self._plan
        self._plan, self._plan_for = None, ()
        packed = [m.native_packed() if isinstance(m, PackedLinear) else None for m in gemms]
        if any(p is None for p in packed):
            return None
        from structspec.kernels.cpu_forward import LayerWeights

        weights = [LayerWeights(layer.norm1, layer.eps1, *packed[4 * i:4 * i + 2], layer.norm2, layer.eps2,
                                *packed[4 * i + 2:4 * i + 4]) for i, layer in enumerate(self.layers)]
        self._plan = self.layer_loop.plan(self.linear, self.ops, attention, weights, self.heads, self.kv_heads,
                                          self.layers[0].intermediate)
        self._plan_for = stamp
        return self._plan


def _kept_rows(logits_rows: torch.Tensor, rows: int) -> torch.Tensor | None:
    """The rows a pass's last layer runs its o projection and MLP over, after an attention over
    all `rows` (which writes every row's keys and values): what follows it feeds only the final
    norm and the lm_head, so only the logits rows (docs/kernels.md). None where those are every
    row (the runner's logits rows are indices in order, so then they are all rows as they lie)."""
    return logits_rows if len(logits_rows) < rows else None


def _version(t: torch.Tensor) -> int | None:
    """t's in-place change counter (None for an inference tensor, which keeps none)."""
    try:
        return t._version
    except RuntimeError:
        return None
