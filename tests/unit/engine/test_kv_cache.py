"""The prefix cache's entries as the native attention reads them (kv_cache.native_table): a slot
that computed or copied a cached prefix names its entry; an evicted entry frees its tensors and
is named no more."""

from __future__ import annotations

import torch

from structspec.engine.kv_cache import KVCache, KVLayout, LayerShape, Segment, Slot, native_table, segment_table

CPU = torch.device("cpu")
LAYOUT = KVLayout((LayerShape(2, 8, 8, torch.float32), LayerShape(2, 8, 8, torch.float32)))


def filled(kv: KVCache, tokens: int) -> Slot:
    slot = kv.allocate(32)
    for t in slot.keys + slot.values:
        t[:, :tokens] = torch.randn(t.shape[0], tokens, t.shape[2])
    slot.length = tokens
    return slot


def test_slots_name_the_entry_they_share_until_it_is_evicted():
    kv = KVCache(LAYOUT, 1 << 20, lambda capacity: Slot(LAYOUT, capacity, CPU), prefix_max_bytes=1 << 20)
    first = filled(kv, 10)
    kv.remember_prefix(tuple(range(10)), first)
    entry = first.shared
    assert entry is not None and entry.length == 10 and len(kv.prefix) == 1
    for got, slot_buffer in zip(entry.keys + entry.values, first.keys + first.values):
        assert got.is_contiguous() and torch.equal(got, slot_buffer[:, :10])
        assert got.data_ptr() != slot_buffer.data_ptr()  # a copy, not a view the slot overwrites
    second = kv.allocate(32)
    second.copy_prefix_from(kv.prefix.get(tuple(range(10))))
    assert second.shared is entry and second.length == 10
    plain = filled(kv, 4)
    segments = [Segment(first, 0, 1, 10), Segment(second, 1, 2, 10), Segment(plain, 3, 1, 4)]
    table = native_table(segments)
    base = segment_table(segments)
    assert table.shape == (4 * 2 + 6, 3) and torch.equal(table[:base.shape[0]], base)
    shared = table[base.shape[0]:]
    assert shared[:, 2].tolist() == [0] * 6  # the plain slot names no entry
    assert shared[:4, 0].tolist() == entry.addresses and shared[:4, 1].tolist() == entry.addresses
    assert shared[4:, :2].tolist() == [[10, 10], [10, 10]]  # length, capacity
    kv.prefix.evict(kv.prefix.nbytes)
    assert len(kv.prefix) == 0 and entry.keys == [] and entry.values == []
    assert torch.equal(native_table(segments), base)  # the slots read their own copies again


def test_the_native_attention_takes_decode_rows_and_short_chunks_over_a_cached_past():
    """Step.native_split: decode and verification segments and prefill chunks of up to
    NATIVE_PREFILL_MAX_ROWS over a cached past go to the C kernel; first chunks and longer ones
    stay with SDPA."""
    from structspec.engine.kv_cache import NATIVE_PREFILL_MAX_ROWS, Step

    kv = KVCache(LAYOUT, 1 << 24, lambda capacity: Slot(LAYOUT, capacity, CPU), prefix_max_bytes=0)
    slots = [kv.allocate(1024) for _ in range(5)]
    long = NATIVE_PREFILL_MAX_ROWS + 1
    segments = [Segment(slots[0], 0, 1, 40),                               # decode
                Segment(slots[1], 1, 4, 40),                               # verification
                Segment(slots[2], 5, NATIVE_PREFILL_MAX_ROWS, 139),        # a document after its prefix
                Segment(slots[3], 5 + NATIVE_PREFILL_MAX_ROWS, 64, 0),     # a first chunk
                Segment(slots[4], 69 + NATIVE_PREFILL_MAX_ROWS, long, 300)]  # a long later chunk
    table, rest = Step(segments, "native").native_split()
    assert table.shape[1] == 3 and table[2 * 2 + 1].tolist() == [1, 4, NATIVE_PREFILL_MAX_ROWS]
    assert rest == segments[3:]
