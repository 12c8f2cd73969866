"""The prefix cache's entries as the native attention reads them (kv_cache.native_table): a slot
that computed or copied a cached prefix names its entry; an evicted entry frees its tensors and
is named no more."""

from __future__ import annotations

import pytest
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



def test_a_slot_sharing_the_start_of_an_entry_names_how_much_it_shares_and_the_entrys_stride():
    """A prompt that begins as a cached prefix does (another schema with the same instruction and
    first fields) copies that start: the table gives the native attention the rows it shares and
    the entry's own row count, the stride of the entry's buffers."""
    kv = KVCache(LAYOUT, 1 << 20, lambda capacity: Slot(LAYOUT, capacity, CPU), prefix_max_bytes=1 << 20)
    first = filled(kv, 10)
    kv.remember_prefix(tuple(range(10)), first)
    entry, n = kv.prefix.longest_start(tuple(range(6)) + (99, 98, 97))
    assert entry is first.shared and n == 6
    assert kv.prefix.longest_start((5, 6)) == (None, 0)
    second = kv.allocate(32)
    second.copy_prefix_from(entry, n)
    assert second.length == 6 and second.shared is entry and second.shared_len == 6
    for got, want in zip(second.keys + second.values, first.keys + first.values):
        assert torch.equal(got[:, :6], want[:, :6])
    table = native_table([Segment(first, 0, 1, 10), Segment(second, 1, 3, 6)])
    assert table[-2:].tolist() == [[10, 6], [10, 10]]  # rows shared, then the entry's stride
    for bad in (0, 11):
        with pytest.raises(ValueError, match="of a 10-token prefix entry"):
            second.copy_prefix_from(entry, bad)


def test_the_native_attention_takes_every_segment_of_a_step_in_one_table():
    """Step.native_table: decode, verification and prefill segments alike (the kernel splits a
    long chunk into 64-row work items), built once per step."""
    from structspec.engine.kv_cache import Step

    kv = KVCache(LAYOUT, 1 << 24, lambda capacity: Slot(LAYOUT, capacity, CPU), prefix_max_bytes=0)
    slots = [kv.allocate(1024) for _ in range(4)]
    segments = [Segment(slots[0], 0, 1, 40), Segment(slots[1], 1, 4, 40),  # decode, verification
                Segment(slots[2], 5, 300, 139), Segment(slots[3], 305, 512, 0)]  # a later and a first chunk
    step = Step(segments, "native")
    table = step.native_table()
    assert torch.equal(table, native_table(segments)) and table[2 * 2 + 1].tolist() == [1, 4, 300, 512]
    assert step.native_table() is table
