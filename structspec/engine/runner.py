"""The target model's forward pass over one step's packed rows.

BatchedRunner runs every sequence's new rows as one row of tokens through the model with
structspec's ragged attention (kv_cache.py; on CUDA its Triton kernels, kernels/attention.py)
swapped in for the model's own: one forward pass per step whatever the batch. A model that
cannot run that way (its attention does not go through transformers' attention interface,
or it needs soft-capping or sinks) is found by a probe at start-up and served by
SequentialRunner: the same steps, one forward pass per sequence over its own transformers
DynamicCache.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
from dataclasses import dataclass

import torch
from transformers import DynamicCache

from structspec.engine.kv_cache import (ATTENTION_NAME, CURRENT, Discovery, KVLayout, LayerShape, Segment, Slot, Step,
                                        native_layout, register_attention)
from structspec.engine.lean import LeanForward

log = logging.getLogger(__name__)

PROBE_TOKENS = 7  # prompt of the probe: a 4-token chunk, then 3 rows verified together
PROBE_SPLIT = 4


@dataclass
class StepInputs:
    """One forward pass: T packed rows, the sequences they belong to, and which rows need logits.

    input_ids, positions: [T] long; logits_rows: [R] long, indices into the T rows (in order);
    allowed: None, or int32 [R, words], each logits row's grammar bitmask (kernels/bitmask.py),
    offered so that the forward may leave the logits it forbids at -inf (the lean forward's
    pruned lm_head, engine/packed.py): the logits it allows are the same either way.
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    segments: list[Segment]
    logits_rows: torch.Tensor
    allowed: torch.Tensor | None = None


@contextlib.contextmanager
def attention_implementation(model, name: str):
    """Run the model with attention implementation `name` for the duration of the block."""
    config = model.config
    before = config._attn_implementation
    config._attn_implementation = name
    try:
        yield
    finally:
        config._attn_implementation = before


def _accepts_logits_to_keep(model) -> bool:
    return "logits_to_keep" in inspect.signature(model.forward).parameters


def attention_backend(kernel_backend: str, device: torch.device) -> str:
    """The ragged attention the batched runner uses: "triton" when asked for, or under "auto" on
    CUDA when triton imports; "native" (kernels/cpu_attention.c) under "auto" on a CPU; otherwise
    "torch". (Unlike the verification kernels, "auto" never takes Triton's CPU interpreter here:
    it would run every layer of every step in numpy.)"""
    if kernel_backend == "triton":
        return "triton"
    if kernel_backend == "auto" and device.type == "cuda":
        from structspec.kernels._triton import triton_available

        return "triton" if triton_available() else "torch"
    if kernel_backend == "auto" and device.type == "cpu":
        return "native"
    return "torch"


class BatchedRunner:
    """Packed rows of many sequences in one pass: through the model's own forward with the
    ragged attention swapped in, or through `lean` (engine/lean.py), the same arithmetic in
    fewer operator calls."""

    batched = True

    def __init__(self, model, layout: KVLayout, attention: str = "torch", lean: LeanForward | None = None,
                 cache_dir=None):
        self.model = model
        self.attention = attention
        self.lean = lean
        self.device = next(model.parameters()).device
        self._keep = _accepts_logits_to_keep(model)
        self.native = None
        if attention == "native":  # RuntimeError when it cannot serve this model
            self.native, layout = native_layout(layout, next(model.parameters()).dtype, self.device, cache_dir)
        self.layout = layout
        self.cache_dir = cache_dir

    def make_slot(self, capacity: int) -> Slot:
        return Slot(self.layout, capacity, self.device)

    @torch.inference_mode()
    def forward(self, step: StepInputs) -> torch.Tensor:
        """Logits [R, V] of the rows in step.logits_rows; every segment's slot grows by its rows."""
        token = CURRENT.set(Step(step.segments, self.attention, self.native))
        try:
            if self.lean is not None:
                logits = self.lean(step.input_ids, step.positions, step.logits_rows, step.allowed)
            else:
                with attention_implementation(self.model, ATTENTION_NAME):
                    kwargs = {"logits_to_keep": step.logits_rows} if self._keep else {}
                    out = self.model(input_ids=step.input_ids.unsqueeze(0), position_ids=step.positions.unsqueeze(0),
                                     use_cache=False, **kwargs)
                logits = out.logits[0] if self._keep else out.logits[0][step.logits_rows]
        finally:
            CURRENT.reset(token)
        for seg in step.segments:
            seg.slot.length = seg.past + seg.rows
        return logits


class CacheSlot:
    """SequentialRunner's per-sequence KV: a transformers DynamicCache (appends copy; crop is a view)."""

    def __init__(self, model, capacity: int, nbytes: int):
        self.cache = DynamicCache(config=model.config)
        self.capacity = capacity
        self.nbytes = nbytes
        self.length = 0

    def rollback(self, num_tokens: int) -> None:
        if not 0 <= num_tokens <= self.length:
            raise ValueError(f"cannot roll back {num_tokens} of {self.length} cached tokens")
        if num_tokens:
            self.cache.crop(-num_tokens)
        self.length -= num_tokens


class SequentialRunner:
    """Fallback for models that cannot run packed: one forward pass per sequence per step."""

    batched = False
    attention = "model"  # the model's own attention, over a transformers DynamicCache per sequence

    def __init__(self, model, layout: KVLayout):
        self.model = model
        self.layout = layout
        self.device = next(model.parameters()).device

    def make_slot(self, capacity: int) -> CacheSlot:
        return CacheSlot(self.model, capacity, capacity * self.layout.bytes_per_token)

    @torch.inference_mode()
    def forward(self, step: StepInputs) -> torch.Tensor:
        rows = step.logits_rows.tolist()
        parts = []
        for seg in step.segments:
            lo, hi = seg.start, seg.start + seg.rows
            wanted = [r - lo for r in rows if lo <= r < hi]
            out = self.model(input_ids=step.input_ids[lo:hi].unsqueeze(0),
                             position_ids=step.positions[lo:hi].unsqueeze(0),
                             past_key_values=seg.slot.cache, use_cache=True)
            seg.slot.length = seg.past + seg.rows
            if wanted:
                parts.append(out.logits[0, wanted])
        if not parts:
            return torch.empty(0, 0, device=self.device)
        return torch.cat(parts)


def _probe_inputs(model) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The probe's token ids, positions, and the model's own logits for them."""
    device = next(model.parameters()).device
    vocab = model.get_output_embeddings().weight.shape[0]
    ids = torch.arange(PROBE_TOKENS, device=device) * 997 % max(vocab - 1, 1) + 1
    positions = torch.arange(PROBE_TOKENS, device=device)
    with torch.inference_mode():
        reference = model(input_ids=ids.unsqueeze(0), position_ids=positions.unsqueeze(0), use_cache=False).logits[0]
    return ids, positions, reference


def _check(runner: BatchedRunner, ids: torch.Tensor, positions: torch.Tensor, reference: torch.Tensor) -> None:
    """Run the probe through `runner` as the engine does (a first chunk, then the rest as one
    multi-row step over the cache); RuntimeError if its logits differ from `reference`."""
    device = ids.device
    slot = Slot(runner.layout, PROBE_TOKENS, device)
    rest = PROBE_TOKENS - PROBE_SPLIT
    runner.forward(StepInputs(ids[:PROBE_SPLIT], positions[:PROBE_SPLIT], [Segment(slot, 0, PROBE_SPLIT, 0)],
                              torch.tensor([PROBE_SPLIT - 1], device=device)))
    got = runner.forward(StepInputs(ids[PROBE_SPLIT:], positions[PROBE_SPLIT:],
                                    [Segment(slot, 0, rest, PROBE_SPLIT)], torch.arange(rest, device=device)))
    want = reference[PROBE_SPLIT:].float()
    scale = want.abs().max().clamp_min(1e-6)
    err = float((got.float() - want).abs().max() / scale)
    tolerance = 1e-3 if reference.dtype == torch.float32 else 5e-2
    if not err <= tolerance:
        raise RuntimeError(f"its logits through the {'lean forward' if runner.lean else 'ragged attention'} differ "
                           f"from its own by {err:.2g} (relative; tolerance {tolerance})")


def probe(model, attention: str = "torch", cache_dir=None) -> BatchedRunner:
    """Check that `model` computes the same logits through the ragged attention (`attention`:
    its torch, Triton or native implementation) as through its own, reading its per-layer KV
    shapes: the runner that passed. Raises RuntimeError saying why it cannot batch."""
    register_attention()
    ids, positions, reference = _probe_inputs(model)
    with torch.inference_mode():
        discovery = Discovery()
        token = CURRENT.set(discovery)
        try:
            with attention_implementation(model, ATTENTION_NAME):
                model(input_ids=ids.unsqueeze(0), position_ids=positions.unsqueeze(0), use_cache=False)
        except NotImplementedError as e:
            raise RuntimeError(str(e)) from None
        finally:
            CURRENT.reset(token)
    num_layers = getattr(model.config, "num_hidden_layers", None)
    if not discovery.shapes or sorted(discovery.shapes) != list(range(len(discovery.shapes))):
        raise RuntimeError("its attention layers do not go through transformers' attention interface")
    if num_layers is not None and len(discovery.shapes) != num_layers:
        raise RuntimeError(f"{len(discovery.shapes)} of its {num_layers} layers went through the attention "
                           "interface")
    layout = KVLayout(tuple(discovery.shapes[i] for i in range(len(discovery.shapes))))
    runner = BatchedRunner(model, layout, attention, cache_dir=cache_dir)
    _check(runner, ids, positions, reference)
    return runner


def with_lean(runner: BatchedRunner, pack: bool, linear=None) -> BatchedRunner:
    """`runner` through the lean forward (engine/lean.py) when the model has its shape and the
    probe's logits agree with the model's own; else `runner` as it was (logged, with why).
    `linear`: kernels.cpu_linear's library for its packed layers, where given."""
    model = runner.model
    name = getattr(model.config, "model_type", type(model).__name__)
    ops = None
    if runner.attention == "native":  # the elementwise steps in C too (kernels/cpu_layer.c)
        try:
            from structspec.kernels.cpu_layer import load

            ops = load(runner.cache_dir)
        except Exception as e:  # no compiler, a failed build: eager torch between the GEMMs
            log.warning("model %s: the fused layer steps are unavailable (%s); running them in torch", name, e)
    layer_loop = None
    if ops is not None and linear is not None:  # a pass's layer loop in C (kernels/cpu_forward.c)
        try:
            from structspec.kernels.cpu_forward import load as load_layer_loop

            layer_loop = load_layer_loop(runner.cache_dir)
        except Exception as e:  # no compiler, a failed build: the layer loop in Python
            log.warning("model %s: the native layer loop is unavailable (%s); looping in Python", name, e)
    lean, why = LeanForward.build(model, pack, ops, linear, layer_loop)
    if lean is None:
        log.info("model %s runs its own forward (the lean forward does not serve it: %s)", name, why)
        return runner
    lean_runner = BatchedRunner(model, runner.layout, runner.attention, lean, runner.cache_dir)
    probe_inputs = None
    while True:
        try:
            probe_inputs = probe_inputs or _probe_inputs(model)
            _check(lean_runner, *probe_inputs)
            return lean_runner
        except Exception as e:  # the C layer loop first falls back to Python's, the fused steps to torch's;
            # then the model's own forward
            if lean.layer_loop is not None:
                log.warning("model %s: the native layer loop failed the check (%s); looping in Python", name, e)
                lean.layer_loop = None
                continue
            if lean.ops is not None:
                log.warning("model %s: the fused layer steps failed the check (%s); running them in torch", name, e)
                lean.ops = None
                continue
            log.warning("model %s: the lean forward failed its check (%s); running the model's own forward", name, e)
            lean.release()
            return runner


def estimate_layout(model) -> KVLayout:
    """Per-layer KV shapes from a one-token DynamicCache pass (for SequentialRunner's budget)."""
    device = next(model.parameters()).device
    cache = DynamicCache(config=model.config)
    with torch.inference_mode():
        model(input_ids=torch.ones(1, 1, dtype=torch.long, device=device), past_key_values=cache, use_cache=True)
    shapes = []
    for layer in cache.layers:
        k, v = layer.keys, layer.values
        shapes.append(LayerShape(k.shape[1], k.shape[-1], v.shape[-1], k.dtype))
    return KVLayout(tuple(shapes))


def make_runner(model, kernel_backend: str = "auto", lean: bool = False, pack: bool = False,
                cache_dir=None, linear=None) -> BatchedRunner | SequentialRunner:
    """The batched runner if the model passes the probe, with the Triton or native attention
    where `kernel_backend` picks it (attention_backend) and it passes too (the native one built
    under `cache_dir`), and through the lean forward where `lean` asks for it and it passes (with
    its linear layers prepacked where `pack`, for `linear`, kernels.cpu_linear's library, where
    given: packed.native_linear); else the sequential runner. Every fallback is logged with its
    reason."""
    name = getattr(model.config, "model_type", type(model).__name__)
    attention = attention_backend(kernel_backend, next(model.parameters()).device)
    runner = None
    if attention != "torch":
        try:
            runner = probe(model, attention, cache_dir)
        except Exception as e:  # a kernel that does not build or does not match: the torch path
            log.warning("model %s: the %s attention failed its check (%s); using the torch attention", name,
                        attention, e)
    if runner is None:
        try:
            runner = probe(model)
        except Exception as e:  # any failure of the probe means: do not batch this model
            log.warning("model %s cannot run batched (%s); decoding one sequence at a time", name, e)
            return SequentialRunner(model, estimate_layout(model))
    return with_lean(runner, pack, linear) if lean else runner
