"""KV storage for the batched engine: one contiguous slot per running sequence.

Design. transformers' continuous batching and vLLM both page the cache: a flat pool of
fixed-size blocks and a block table per request. That shares blocks between requests
(prefix caching by reference) and never fragments, but attention then needs either a
paged-attention kernel (vLLM, flash varlen) or, on the CPU/SDPA path, a gather of every
request's blocks into one contiguous tensor per layer and step (transformers' index-based
update): a copy of the whole live cache on every forward pass.

structspec verifies a few rows per sequence per step against contexts of ~1k tokens, so that
copy would double the memory traffic of attention, which on a CPU already is about half of a
batched decode step. Here each running sequence owns one slot: per layer a [kv_heads,
capacity, head_dim] buffer reserved at admission for its worst case (prompt + max_tokens,
capped by the model's context). Appending writes in place, attention reads a view (no
copy), and rolling back rejected draft tokens is one integer decrement: O(1), never a copy.
The price is reservation by the worst case; the budget counts reserved bytes (on a CPU
untouched pages of a reservation are never resident), so admission waits instead of running
out of memory. Shared prompt prefixes are reused by copying their KV into a new slot
(PrefixCache), a few milliseconds against the seconds their prefill takes.

Attention over the slots has three implementations (Step.attention). "torch": one write pair
and one SDPA call per sequence and layer, reading views of the slots. On a GPU that would be
3 launches per sequence and layer; there "triton" (kernels/attention.py) writes and attends for
the whole batch in two launches per layer, reaching each slot through a table of buffer
addresses, so slots stay where they are. "native" (a CPU's default): kernels/cpu_attention.c
does the same for every decode and verification row in one call per layer, over the same
table, with bf16 slots for bf16 models; prefill chunks keep SDPA.
"""

from __future__ import annotations

import contextvars
import dataclasses
from collections import OrderedDict
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

ATTENTION_NAME = "structspec_ragged"


@dataclass(frozen=True)
class LayerShape:
    kv_heads: int
    key_dim: int
    value_dim: int
    dtype: torch.dtype

    @property
    def bytes_per_token(self) -> int:
        return self.kv_heads * (self.key_dim + self.value_dim) * torch.finfo(self.dtype).bits // 8


@dataclass(frozen=True)
class KVLayout:
    """Per-layer KV shapes, read off the model by a probe forward pass (runner.py)."""

    layers: tuple[LayerShape, ...]

    @property
    def bytes_per_token(self) -> int:
        return sum(s.bytes_per_token for s in self.layers)


class Slot:
    """One sequence's KV: `length` tokens stored, room for `capacity`."""

    def __init__(self, layout: KVLayout, capacity: int, device: torch.device):
        self.capacity = capacity
        self.length = 0
        self.nbytes = capacity * layout.bytes_per_token
        # torch.empty: on a CPU the pages of a reservation become resident only when written.
        self.keys = [torch.empty(s.kv_heads, capacity, s.key_dim, dtype=s.dtype, device=device)
                     for s in layout.layers]
        self.values = [torch.empty(s.kv_heads, capacity, s.value_dim, dtype=s.dtype, device=device)
                       for s in layout.layers]
        # every layer's key buffer address, then every value buffer's: the Triton attention's tables
        self.addresses = [t.data_ptr() for t in self.keys] + [t.data_ptr() for t in self.values]
        # the prefix cache entry whose copy this slot's first tokens are (the native attention reads
        # the entry instead, one copy for every sequence of the batch that shares it; an evicted
        # entry drops its tensors, so holding it keeps no memory beyond the budget)
        self.shared: PrefixEntry | None = None
        self.shared_len = 0  # how many of the entry's first tokens this slot's are (all, or a common start)

    def rollback(self, num_tokens: int) -> None:
        """Forget the last `num_tokens` tokens (their KV is overwritten by the next write)."""
        if not 0 <= num_tokens <= self.length:
            raise ValueError(f"cannot roll back {num_tokens} of {self.length} cached tokens")
        self.length -= num_tokens

    def copy_prefix_from(self, entry: "PrefixEntry", length: int | None = None) -> None:
        """This slot's first `length` tokens (default: all of the entry's) := the entry's: the
        tokens must be the same (a prompt that starts as the entry's key does)."""
        n = entry.length if length is None else length
        if not 0 < n <= entry.length:
            raise ValueError(f"cannot copy {n} tokens of a {entry.length}-token prefix entry")
        for dst, src in zip(self.keys, entry.keys):
            dst[:, :n].copy_(src[:, :n])
        for dst, src in zip(self.values, entry.values):
            dst[:, :n].copy_(src[:, :n])
        self.length = n
        self.shared, self.shared_len = entry, n


@dataclass
class PrefixEntry:
    length: int
    keys: list[torch.Tensor]  # per layer, [kv_heads, length, key_dim] contiguous
    values: list[torch.Tensor]
    nbytes: int

    @property
    def addresses(self) -> list[int]:
        """Every layer's key tensor address, then every value tensor's (as Slot.addresses)."""
        return [t.data_ptr() for t in self.keys] + [t.data_ptr() for t in self.values]


class PrefixCache:
    """KV of shared prompt prefixes (instruction + schema), least recently used first out."""

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self.nbytes = 0
        self._entries: OrderedDict[tuple[int, ...], PrefixEntry] = OrderedDict()
        self.hits = 0
        self.misses = 0
        self.reused_tokens = 0

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: tuple[int, ...]) -> PrefixEntry | None:
        entry = self._entries.get(key)
        if entry is not None:
            self._entries.move_to_end(key)
        return entry

    def longest_start(self, key: tuple[int, ...]) -> tuple[PrefixEntry | None, int]:
        """The entry whose key shares the longest start with `key` (another schema's prompt that
        begins as this one does: the instruction, the first fields), and that start's length;
        (None, 0) if none shares a token."""
        best, best_n = None, 0
        for other, entry in self._entries.items():
            n = 0
            for a, b in zip(other, key):
                if a != b:
                    break
                n += 1
            if n > best_n:
                best, best_n = other, n
        if best is None:
            return None, 0
        self._entries.move_to_end(best)
        return self._entries[best], best_n

    def put(self, key: tuple[int, ...], slot: Slot, layout: KVLayout, limit: int) -> PrefixEntry | None:
        """Keep a copy of `slot`'s first len(key) tokens, evicting older entries so that the
        cache stays within `limit` bytes (and max_bytes): the entry, or None when it cannot fit."""
        length = len(key)
        nbytes = length * layout.bytes_per_token
        limit = min(limit, self.max_bytes)
        if key in self._entries or nbytes > limit:
            return None
        self.evict(self.nbytes + nbytes - limit)
        entry = PrefixEntry(length, [k[:, :length].clone(memory_format=torch.contiguous_format) for k in slot.keys],
                            [v[:, :length].clone(memory_format=torch.contiguous_format) for v in slot.values], nbytes)
        self._entries[key] = entry
        self.nbytes += nbytes
        return entry

    def evict(self, nbytes: int) -> int:
        """Drop least recently used entries until `nbytes` are freed (or none is left)."""
        freed = 0
        while freed < nbytes and self._entries:
            _, entry = self._entries.popitem(last=False)
            entry.keys, entry.values = [], []  # freed now, though slots that copied it still name it
            freed += entry.nbytes
            self.nbytes -= entry.nbytes
        return freed


class KVCache:
    """Slots and prefix entries under one byte budget."""

    def __init__(self, layout: KVLayout, budget_bytes: int, make_slot, prefix_max_bytes: int):
        self.layout = layout
        self.budget_bytes = budget_bytes
        self.make_slot = make_slot  # capacity -> a slot (Slot, or the sequential runner's CacheSlot)
        self.reserved_bytes = 0
        self.prefix = PrefixCache(min(prefix_max_bytes, budget_bytes))
        self.peak_bytes = 0

    def bytes_for(self, capacity: int) -> int:
        return capacity * self.layout.bytes_per_token

    def fits_ever(self, capacity: int) -> bool:
        return self.bytes_for(capacity) <= self.budget_bytes

    def allocate(self, capacity: int) -> Slot | None:
        """A slot for `capacity` tokens, evicting prefix entries if that makes room; None if
        the budget is full of running sequences (the caller waits for one to finish)."""
        need = self.bytes_for(capacity)
        over = self.reserved_bytes + self.prefix.nbytes + need - self.budget_bytes
        if over > 0:
            if self.reserved_bytes + need > self.budget_bytes:
                return None
            self.prefix.evict(over)
        slot = self.make_slot(capacity)
        self.reserved_bytes += slot.nbytes
        self.peak_bytes = max(self.peak_bytes, self.reserved_bytes + self.prefix.nbytes)
        return slot

    def release(self, slot: Slot) -> None:
        self.reserved_bytes -= slot.nbytes

    def remember_prefix(self, key: tuple[int, ...], slot: Slot) -> None:
        """Keep `slot`'s prefix if the budget has room beside the running sequences."""
        entry = self.prefix.put(key, slot, self.layout, limit=self.budget_bytes - self.reserved_bytes)
        if entry is not None:
            self.peak_bytes = max(self.peak_bytes, self.reserved_bytes + self.prefix.nbytes)
            slot.shared, slot.shared_len = entry, entry.length


# --- attention over slots -----------------------------------------------------------------


@dataclass
class Segment:
    """One sequence's rows in a packed forward pass: rows [start, start + rows) of the step's
    tokens, appended after the `past` tokens already in `slot`."""

    slot: Slot
    start: int
    rows: int
    past: int
    _masks: dict = field(default_factory=dict)

    def mask(self, window: int | None, device: torch.device) -> torch.Tensor | None:
        """[rows, past + rows] bool (True = may attend), or None when every key is visible."""
        total = self.past + self.rows
        needs_window = window is not None and total > window
        if not needs_window and (self.rows == 1 or self.past == 0):
            return None  # one row sees every key; a first chunk is plain causal (is_causal)
        key = window if needs_window else None
        if key not in self._masks:
            q = torch.arange(self.past, total, device=device).unsqueeze(1)
            k = torch.arange(total, device=device).unsqueeze(0)
            allowed = k <= q
            if needs_window:
                allowed &= k > q - window
            self._masks[key] = allowed
        return self._masks[key]


class Discovery:
    """A probe pass: records each layer's KV shape and attends causally within the rows."""

    def __init__(self):
        self.shapes: dict[int, LayerShape] = {}


class Step:
    """One forward pass as the attention function sees it: its segments, and how to attend.

    attention "torch": one write pair and one SDPA call per segment and layer (the CPU path).
    attention "triton": kernels/attention.py, two launches per layer for the whole batch; the
    buffer tables of every layer go to the device in one copy, on the first layer's call.
    """

    def __init__(self, segments: list[Segment], attention: str = "torch", native=None):
        self.segments = segments
        self.attention = attention
        self.native = native  # kernels.cpu_attention.NativeAttention, with attention "native"
        self.max_rows = max((seg.rows for seg in segments), default=0)
        self._tables: torch.Tensor | None = None  # [2 * layers + 4, S] int64
        self._native: torch.Tensor | None = None  # native_table of every segment

    def tables(self, layer: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(key addresses [S], value addresses [S], [start, rows, past, capacity] [4, S]) of a layer."""
        if self._tables is None:
            self._tables = segment_table(self.segments).to(device)
        layers = (self._tables.shape[0] - 4) // 2
        return self._tables[layer], self._tables[layers + layer], self._tables[2 * layers:]

    def native_table(self) -> torch.Tensor:
        """native_table(self.segments), built once per step, for the native attention."""
        if self._native is None:
            self._native = native_table(self.segments)
        return self._native


def segment_table(segments: list[Segment]) -> torch.Tensor:
    """int64 [2 * layers + 4, S] on the CPU: every layer's key buffer address per segment, then
    every layer's value buffer address, then start, rows, past and capacity (the layout the
    Triton and native attentions read)."""
    addresses = torch.tensor([seg.slot.addresses for seg in segments], dtype=torch.int64).t()
    meta = torch.tensor([[seg.start for seg in segments], [seg.rows for seg in segments],
                         [seg.past for seg in segments], [seg.slot.capacity for seg in segments]], dtype=torch.int64)
    return torch.cat([addresses, meta])


def native_table(segments: list[Segment]) -> torch.Tensor:
    """segment_table, and when a segment's slot holds a copy of a prefix cache entry, 2 * layers
    + 2 more rows: each segment's entry key addresses, value addresses, the rows it shares with
    the entry (all of them, or a common start) and the entry's capacity (0 where none), from
    which the native attention reads the prefix (cpu_attention.c's header)."""
    table = segment_table(segments)
    entries = [seg.slot.shared if seg.slot.shared is not None and seg.slot.shared.keys else None
               for seg in segments]
    if not any(entries):
        return table.contiguous()
    none = [0] * (2 * len(segments[0].slot.keys))
    shared = torch.tensor([e.addresses if e is not None else none for e in entries], dtype=torch.int64).t()
    # the rows each slot shares with its entry, then the entry's row count (its buffers' stride)
    meta = torch.tensor([[seg.slot.shared_len if e is not None else 0 for seg, e in zip(segments, entries)],
                         [e.length if e is not None else 0 for e in entries]], dtype=torch.int64)
    return torch.cat([table, shared, meta]).contiguous()


# The step being run (set by the runner around one forward pass). A context variable rather
# than a model kwarg: it reaches the attention function even through models that do not pass
# unknown keyword arguments down to their attention modules.
CURRENT: contextvars.ContextVar[Step | Discovery | None] = contextvars.ContextVar("structspec_step", default=None)


def ragged_attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask, scaling: float | None = None, dropout: float = 0.0, **kwargs):
    """transformers attention function for packed rows of many sequences.

    query [1, heads, T, D]; key, value [1, kv_heads, T, D] (positions already applied): the
    new rows of every sequence in the step, packed. Each sequence's rows are written into its
    slot and attend to its cached tokens plus its own earlier rows. Returns [1, T, heads, Dv].
    """
    step = CURRENT.get()
    if step is None:
        raise RuntimeError("structspec's ragged attention ran outside an engine step")
    if kwargs.get("softcap") is not None or getattr(module, "sinks", None) is not None:
        raise NotImplementedError("attention logit soft-capping and attention sinks are not supported")
    window = getattr(module, "sliding_window", None)
    gqa = query.shape[1] != key.shape[1]
    if isinstance(step, Discovery):
        step.shapes[module.layer_idx] = LayerShape(key.shape[1], key.shape[-1], value.shape[-1],
                                                   storage_dtype(key.dtype, key.device))
        rows = query.shape[2]
        seg = Segment(slot=None, start=0, rows=rows, past=0)  # type: ignore[arg-type]
        mask = seg.mask(window, query.device)
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, is_causal=mask is None and rows > 1,
                                             scale=scaling, enable_gqa=gqa)
        return out.transpose(1, 2), None

    layer = module.layer_idx
    if step.attention == "triton":
        from structspec.kernels.attention import attend

        k_table, v_table, seg_table = step.tables(layer, query.device)
        out = attend(query[0].transpose(0, 1), key[0].transpose(0, 1), value[0].transpose(0, 1), k_table, v_table,
                     seg_table, step.max_rows, scale=scaling, window=window)
        return out.unsqueeze(0), None
    if step.attention == "native":
        return native_ragged_attention(step, layer, query, key, value, window, scaling), None
    if query.device.type == "cpu" and query.dtype in (torch.bfloat16, torch.float16):
        return upcast_ragged_attention(step, layer, query, key, value, window, scaling), None
    out = query.new_empty(query.shape[:-1] + (value.shape[-1],))
    for seg in step.segments:
        k_buf, v_buf = seg.slot.keys[layer], seg.slot.values[layer]
        end, rows = seg.past + seg.rows, slice(seg.start, seg.start + seg.rows)
        k_buf[:, seg.past:end] = key[0, :, rows]
        v_buf[:, seg.past:end] = value[0, :, rows]
        mask = seg.mask(window, query.device)
        causal = mask is None and seg.rows > 1
        out[:, :, rows] = F.scaled_dot_product_attention(
            query[:, :, rows], k_buf[:, :end].unsqueeze(0), v_buf[:, :end].unsqueeze(0),
            attn_mask=mask, is_causal=causal, scale=scaling, enable_gqa=gqa)
    return out.transpose(1, 2), None


def storage_dtype(dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The dtype a layer's KV is stored in: the model's, except bf16/fp16 on a CPU, stored in fp32
    (upcast_ragged_attention: decode rows attend in fp32 there, and fp32 storage spares them a
    conversion of every cached key and value on every pass)."""
    return torch.float32 if device.type == "cpu" and dtype in (torch.bfloat16, torch.float16) else dtype


def upcast_ragged_attention(step: Step, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                            window: int | None, scaling: float | None) -> torch.Tensor:
    """ragged_attention's CPU path for bf16/fp16 models, whose slots hold fp32 (storage_dtype).
    Decode and verification rows attend in fp32 straight over the slot (the query upcast once
    for the whole step, the result rounded back once); a first prefill chunk attends over its
    own rows in the model's dtype, and a long later chunk over its slot rounded down.
    Returns [1, T, heads, Dv]."""
    q32 = query.float()
    out = torch.empty(query.shape[:-1] + (value.shape[-1],), dtype=torch.float32, device=query.device)
    for seg in step.segments:
        rows = slice(seg.start, seg.start + seg.rows)
        if attends_in_fp32(seg):  # decode, verification: fp32 over the slot
            k_buf, v_buf = seg.slot.keys[layer], seg.slot.values[layer]
            end = seg.past + seg.rows
            k_buf[:, seg.past:end] = key[0, :, rows]
            v_buf[:, seg.past:end] = value[0, :, rows]
            out[:, :, rows] = F.scaled_dot_product_attention(
                q32[:, :, rows], k_buf[:, :end].unsqueeze(0), v_buf[:, :end].unsqueeze(0),
                attn_mask=seg.mask(window, query.device), scale=scaling, enable_gqa=query.shape[1] != key.shape[1])
        else:
            out[:, :, rows] = prefill_attention(seg, layer, query, key, value, window, scaling)
    return out.to(query.dtype).transpose(1, 2)


def prefill_attention(seg: Segment, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      window: int | None, scaling: float | None) -> torch.Tensor:
    """A prefill chunk's rows written into its slot and attended in the model's dtype by SDPA: a
    first chunk over its own rows, a later one over its slot (cast to the model's dtype where
    the slot holds fp32). [1, heads, rows, Dv]; query/key/value as ragged_attention gets them."""
    k_buf, v_buf = seg.slot.keys[layer], seg.slot.values[layer]
    end, rows = seg.past + seg.rows, slice(seg.start, seg.start + seg.rows)
    k_buf[:, seg.past:end] = key[0, :, rows]
    v_buf[:, seg.past:end] = value[0, :, rows]
    mask = seg.mask(window, query.device)
    if seg.past == 0:
        keys, values = key[:, :, rows], value[:, :, rows]
    else:
        keys = k_buf[:, :end].to(query.dtype).unsqueeze(0)
        values = v_buf[:, :end].to(query.dtype).unsqueeze(0)
    return F.scaled_dot_product_attention(query[:, :, rows], keys, values, attn_mask=mask,
                                          is_causal=mask is None and seg.rows > 1, scale=scaling,
                                          enable_gqa=query.shape[1] != key.shape[1])


def attends_in_fp32(seg: Segment) -> bool:
    """Decode and verification rows (up to UPCAST_MAX_ROWS past a first chunk): on a CPU they
    attend in fp32 over the slot; other segments are prefill chunks, attended in the model's dtype."""
    return seg.rows <= UPCAST_MAX_ROWS and (seg.rows == 1 or seg.past > 0)


def native_ragged_attention(step: Step, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                            window: int | None, scaling: float | None) -> torch.Tensor:
    """ragged_attention's "native" path (a CPU): every segment of the step, decode, verification
    and prefill chunks alike, appended and attended in one call of kernels/cpu_attention.c (fp32
    arithmetic over fp32 or bf16 slots; a long chunk split into 64-row work items). Returns
    [1, T, heads, Dv]."""
    q, k, v = query[0].transpose(0, 1), key[0].transpose(0, 1), value[0].transpose(0, 1)  # [T, heads, dim]
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    return native_attention_rows(step, layer, q, k, v, window, scale, check=True).unsqueeze(0)


def native_attention_rows(step: Step, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          window: int | None, scale: float, check: bool) -> torch.Tensor:
    """native_ragged_attention over rows as they come out of a qkv GEMM: q [T, heads, D], k [T,
    kv_heads, D], v [T, kv_heads, Dv] (any row and head strides); returns [T, heads, Dv] in q's
    dtype. check=False skips the kernel's argument checks (the lean forward's layers after its
    first: the same shapes, layer after layer)."""
    out = torch.empty(q.shape[0], q.shape[1], v.shape[-1], dtype=torch.float32, device=q.device)
    keys = step.segments[0].slot.keys
    step.native.attend(q, k, v, out, step.native_table(), len(keys), layer, scale, window, keys[layer].dtype,
                       check=check)
    return out.to(q.dtype)


def native_layout(layout: KVLayout, dtype: torch.dtype, device: torch.device, cache_dir=None):
    """(the compiled attention for `layout`'s head sizes, the layout its slots take: the model's
    bf16 kept as it is, fp32 for fp32), or RuntimeError saying why the native attention cannot
    serve this model (not a CPU, fp16, head sizes differing between layers, no C compiler)."""
    if device.type != "cpu":
        raise RuntimeError(f"the native attention runs on a CPU, not {device.type}")
    if dtype not in (torch.float32, torch.bfloat16):
        raise RuntimeError(f"the native attention takes fp32 or bf16 models, not {dtype}")
    dims = {(s.key_dim, s.value_dim) for s in layout.layers}
    if len(dims) != 1:
        raise RuntimeError(f"its layers have different head sizes {sorted(dims)}")
    (key_dim, value_dim), = dims
    if key_dim % 8 or value_dim % 8:
        raise RuntimeError(f"head sizes {key_dim}/{value_dim} are not multiples of 8")
    from structspec.kernels.cpu_attention import load

    lib = load(key_dim, value_dim, cache_dir)
    return lib, KVLayout(tuple(dataclasses.replace(s, dtype=dtype) for s in layout.layers))


# torch 2.13's CPU SDPA in bf16/fp16 costs ~4x its fp32 time on a decode row (one query, 512
# keys: 497 against 121 us measured, docs/benchmarks.md), which made a bf16 decode pass slower
# than an fp32 one. Decode and verification rows (up to this many per sequence, past the first
# chunk) therefore attend in fp32 matmuls on the CPU (upcast_ragged_attention).
UPCAST_MAX_ROWS = 32


def register_attention() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, ragged_attention)
