"""Ragged attention over per-sequence KV buffers, in two launches per layer.

One forward pass of the batched engine carries the new rows of S sequences packed into T
rows. Sequence s owns rows [start_s, start_s + rows_s); its KV lives in a buffer of its own
([kv_heads, capacity_s, head_dim], contiguous) holding past_s tokens already. Per layer:

* ``append_kv`` writes every sequence's new keys and values at [past_s, past_s + rows_s) of
  its buffers;
* ``attend`` computes, for every new row i of sequence s, attention over that sequence's keys
  [0, past_s + i] (and, with a sliding window W, only those > past_s + i - W).

The torch path (the engine's CPU path, structspec/engine/kv_cache.py) does this with one
write pair and one SDPA call per sequence and layer; on a GPU that is 3S kernel launches per
layer, which for 64 sequences costs more than the model's own work. Here each launch covers
every sequence: buffers are reached through a table of their addresses (int64, one per
sequence; the grouped-GEMM recipe of the Triton tutorials), so no cache is copied or padded,
and rolling a sequence back stays an integer decrement.

Layout of the step description ``seg``: int64 [4, S], rows start, rows, past, capacity.
``k_table`` / ``v_table``: int64 [S], ``tensor.data_ptr()`` of each sequence's key / value
buffer for this layer; the buffers must stay alive (the engine's slots own them) and have the
dtype of ``key`` / ``value``. Grouped-query attention: query head h reads kv head
h // (heads / kv_heads), as transformers' ``repeat_kv`` does.

``attention_reference`` is the readable oracle the tests compare against.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from structspec.kernels._triton import interpreter_enabled, next_power_of_2, require_triton, tl, triton

__all__ = ["append_kv", "attend", "attention_reference", "step_tables"]

BLOCK_M = 16  # query rows per program (tl.dot needs 16)
BLOCK_N = 64  # keys per inner iteration
BLOCK_R = 16  # rows per iteration of the append


# num_seqs changes every step: not specialised, so a new batch size never compiles a new variant
@triton.jit(do_not_specialize=["num_seqs"])
def _append_kv_kernel(
    key_ptr,  # [T, KVH, D] the step's new keys (any row/head strides, unit last stride)
    value_ptr,  # [T, KVH, DV]
    k_table_ptr,  # [S] int64: address of sequence s's [KVH, capacity_s, D] key buffer
    v_table_ptr,  # [S] int64: its [KVH, capacity_s, DV] value buffer
    seg_ptr,  # [4, S] int64: start, rows, past, capacity
    num_seqs,
    stride_kt, stride_kh,
    stride_vt, stride_vh,
    D: tl.constexpr, DV: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
):
    s = tl.program_id(0)
    h = tl.program_id(1).to(tl.int64)
    start = tl.load(seg_ptr + s).to(tl.int64)
    rows = tl.load(seg_ptr + num_seqs + s)
    past = tl.load(seg_ptr + 2 * num_seqs + s).to(tl.int64)
    cap = tl.load(seg_ptr + 3 * num_seqs + s).to(tl.int64)
    k_dst = tl.load(k_table_ptr + s).to(tl.pointer_type(key_ptr.dtype.element_ty))
    v_dst = tl.load(v_table_ptr + s).to(tl.pointer_type(value_ptr.dtype.element_ty))
    d = tl.arange(0, BLOCK_D)
    dv = tl.arange(0, BLOCK_DV)
    for r0 in range(0, rows, BLOCK_R):
        r = r0 + tl.arange(0, BLOCK_R)
        ok = r < rows
        k = tl.load(key_ptr + (start + r)[:, None] * stride_kt + h * stride_kh + d[None, :],
                    mask=ok[:, None] & (d[None, :] < D))
        tl.store(k_dst + (h * cap + past + r)[:, None] * D + d[None, :], k, mask=ok[:, None] & (d[None, :] < D))
        v = tl.load(value_ptr + (start + r)[:, None] * stride_vt + h * stride_vh + dv[None, :],
                    mask=ok[:, None] & (dv[None, :] < DV))
        tl.store(v_dst + (h * cap + past + r)[:, None] * DV + dv[None, :], v, mask=ok[:, None] & (dv[None, :] < DV))


@triton.jit(do_not_specialize=["num_seqs", "window"])
def _attend_kernel(
    q_ptr,  # [T, H, D] the step's queries (unit last stride)
    out_ptr,  # [T, H, DV]
    k_table_ptr,  # [S] int64, as in _append_kv_kernel (already holding this step's rows)
    v_table_ptr,  # [S] int64
    seg_ptr,  # [4, S] int64: start, rows, past, capacity
    num_seqs,
    stride_qt, stride_qh,
    stride_ot, stride_oh,
    scale,
    window,  # sliding window in tokens (used only with HAS_WINDOW)
    GROUP: tl.constexpr,  # query heads per kv head
    D: tl.constexpr, DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    # products in fp32 with IEEE precision (no TF32), as torch's fp32 matmul: fp32 inputs, and
    # bf16 ones under the CPU interpreter (whose tl.dot on bf16 is wrong in triton 3.9)
    DOT_FP32: tl.constexpr,
):
    s = tl.program_id(0)
    h = tl.program_id(1)
    block = tl.program_id(2)
    rows = tl.load(seg_ptr + num_seqs + s)
    if block * BLOCK_M >= rows:
        return
    start = tl.load(seg_ptr + s).to(tl.int64)
    past = tl.load(seg_ptr + 2 * num_seqs + s)
    cap = tl.load(seg_ptr + 3 * num_seqs + s).to(tl.int64)
    kv_head = (h // GROUP).to(tl.int64)
    keys = tl.load(k_table_ptr + s).to(tl.pointer_type(q_ptr.dtype.element_ty)) + kv_head * cap * D
    values = tl.load(v_table_ptr + s).to(tl.pointer_type(out_ptr.dtype.element_ty)) + kv_head * cap * DV

    r = block * BLOCK_M + tl.arange(0, BLOCK_M)
    ok = r < rows
    d = tl.arange(0, BLOCK_D)
    dv = tl.arange(0, BLOCK_DV)
    q = tl.load(q_ptr + (start + r)[:, None] * stride_qt + h * stride_qh + d[None, :],
                mask=ok[:, None] & (d[None, :] < D), other=0.0)
    if DOT_FP32:
        q = q.to(tl.float32)
    pos = past + r  # each row's own position: it sees keys [0, pos]
    end = past + tl.minimum(rows, (block + 1) * BLOCK_M)  # keys the block's last row sees, exclusive
    lo = 0
    if HAS_WINDOW:
        lo = tl.maximum(past + block * BLOCK_M - window + 1, 0)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    for n0 in range(lo, end, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        in_range = n < end
        k = tl.load(keys + n[:, None] * D + d[None, :], mask=in_range[:, None] & (d[None, :] < D), other=0.0)
        if DOT_FP32:
            scores = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee") * scale
        else:
            scores = tl.dot(q, tl.trans(k)) * scale
        seen = in_range[None, :] & (n[None, :] <= pos[:, None])
        if HAS_WINDOW:
            seen = seen & (n[None, :] > pos[:, None] - window)
        scores = tl.where(seen, scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with no key yet in view
        p = tl.exp(scores - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(values + n[:, None] * DV + dv[None, :], mask=in_range[:, None] & (dv[None, :] < DV), other=0.0)
        if DOT_FP32:
            acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    # IEEE division (not PTX's approximate one); rows past `rows` (not stored) saw no key
    out = tl.math.div_rn(acc, tl.where(l_i == 0.0, 1.0, l_i)[:, None])
    tl.store(out_ptr + (start + r)[:, None] * stride_ot + h * stride_oh + dv[None, :],
             out.to(out_ptr.dtype.element_ty), mask=ok[:, None] & (dv[None, :] < DV))


def step_tables(k_bufs: list[torch.Tensor], v_bufs: list[torch.Tensor], starts: list[int], rows: list[int],
                pasts: list[int], device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(k_table int64 [S], v_table int64 [S], seg int64 [4, S]) on `device` for one layer's
    buffers; checks that every buffer is contiguous, on `device`, and large enough. (The engine
    builds the tables of all its layers at once from addresses its slots keep: kv_cache.py.)"""
    if not (len(k_bufs) == len(v_bufs) == len(starts) == len(rows) == len(pasts)):
        raise ValueError("k_bufs, v_bufs, starts, rows and pasts must have one entry per sequence")
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:  # "cuda" means the current device; tensors say cuda:N
        device = torch.device("cuda", torch.cuda.current_device())
    caps = []
    for i, (k, v) in enumerate(zip(k_bufs, v_bufs)):
        if not (k.is_contiguous() and v.is_contiguous()):
            raise ValueError(f"the KV buffers of sequence {i} must be contiguous")
        if k.device != device or v.device != device:
            raise ValueError(f"the KV buffers of sequence {i} are on {k.device}, not {device}")
        if k.shape[1] != v.shape[1] or pasts[i] + rows[i] > k.shape[1]:
            raise ValueError(f"sequence {i}: {pasts[i]} + {rows[i]} tokens do not fit its buffer of {k.shape[1]}")
        caps.append(k.shape[1])
    tables = torch.tensor([[k.data_ptr() for k in k_bufs], [v.data_ptr() for v in v_bufs]], dtype=torch.int64)
    seg = torch.tensor([starts, rows, pasts, caps], dtype=torch.int64)
    return tables[0].to(device), tables[1].to(device), seg.to(device)


def _check(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
    if query.dim() != 3 or key.dim() != 3 or value.dim() != 3:
        raise ValueError("query, key and value must be [T, heads, dim]")
    if not (query.shape[0] == key.shape[0] == value.shape[0]) or key.shape[1] != value.shape[1]:
        raise ValueError(f"row or kv-head counts differ: query {tuple(query.shape)}, key {tuple(key.shape)}, "
                         f"value {tuple(value.shape)}")
    if query.shape[1] % key.shape[1]:
        raise ValueError(f"{query.shape[1]} query heads are not a multiple of {key.shape[1]} kv heads")
    if query.shape[2] != key.shape[2]:
        raise ValueError("query and key head dims differ")
    if not (query.dtype == key.dtype == value.dtype):
        raise ValueError("query, key and value must share a dtype")
    if query.stride(-1) != 1 or key.stride(-1) != 1 or value.stride(-1) != 1:
        raise ValueError("query, key and value need a unit last stride")


def append_kv(key: torch.Tensor, value: torch.Tensor, k_table: torch.Tensor, v_table: torch.Tensor,
              seg: torch.Tensor) -> None:
    """Write each sequence's new rows of `key` [T, KVH, D] and `value` [T, KVH, DV] into its
    buffers at [past, past + rows) (one launch for the batch)."""
    require_triton()
    num_seqs = seg.shape[1]
    if num_seqs == 0:
        return
    _append_kv_kernel[(num_seqs, key.shape[1])](
        key, value, k_table, v_table, seg, num_seqs,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        D=key.shape[2], DV=value.shape[2], BLOCK_R=BLOCK_R,
        BLOCK_D=max(16, next_power_of_2(key.shape[2])), BLOCK_DV=max(16, next_power_of_2(value.shape[2])))


def attend(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, k_table: torch.Tensor,
           v_table: torch.Tensor, seg: torch.Tensor, max_rows: int, scale: float | None = None,
           window: int | None = None) -> torch.Tensor:
    """Append `key`/`value` (see append_kv), then attention for every row of `query` [T, H, D]
    over its own sequence's buffers: [T, H, DV]. `max_rows`: the most rows of one sequence (the
    caller knows it without reading `seg` back from the device)."""
    require_triton()
    _check(query, key, value)
    append_kv(key, value, k_table, v_table, seg)
    num_seqs, heads, dim, dim_v = seg.shape[1], query.shape[1], query.shape[2], value.shape[2]
    out = query.new_empty(query.shape[0], heads, dim_v)
    if num_seqs == 0 or max_rows == 0:
        return out
    _attend_kernel[(num_seqs, heads, triton.cdiv(max_rows, BLOCK_M))](
        query, out, k_table, v_table, seg, num_seqs,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        scale if scale is not None else 1.0 / math.sqrt(dim), window or 0,
        GROUP=heads // key.shape[1], D=dim, DV=dim_v, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N,
        BLOCK_D=max(16, next_power_of_2(dim)), BLOCK_DV=max(16, next_power_of_2(dim_v)),
        HAS_WINDOW=window is not None,
        DOT_FP32=query.dtype == torch.float32 or (query.dtype == torch.bfloat16 and interpreter_enabled()))
    return out


def attention_reference(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, k_bufs: list[torch.Tensor],
                        v_bufs: list[torch.Tensor], starts: list[int], rows: list[int], pasts: list[int],
                        scale: float | None = None, window: int | None = None,
                        p_dtype: torch.dtype | None = None) -> torch.Tensor:
    """What `attend` computes, one sequence at a time with explicit masks (writes the buffers too).
    p_dtype: the softmax's probabilities rounded to it before P.V, normalised by the sum of the
    unrounded ones (as the bf16 kernels' P.V: this file's on a GPU, cpu_attention.c's)."""
    out = query.new_empty(query.shape[0], query.shape[1], value.shape[2])
    group = query.shape[1] // key.shape[1]
    for k_buf, v_buf, start, n, past in zip(k_bufs, v_bufs, starts, rows, pasts):
        own = slice(start, start + n)
        k_buf[:, past:past + n] = key[own].transpose(0, 1)
        v_buf[:, past:past + n] = value[own].transpose(0, 1)
        q_pos = torch.arange(past, past + n).unsqueeze(1)
        k_pos = torch.arange(past + n).unsqueeze(0)
        seen = k_pos <= q_pos
        if window is not None:
            seen &= k_pos > q_pos - window
        keys = k_buf[:, :past + n].repeat_interleave(group, 0)
        values = v_buf[:, :past + n].repeat_interleave(group, 0)
        if p_dtype is None:
            out[own] = F.scaled_dot_product_attention(query[own].transpose(0, 1), keys, values,
                                                      attn_mask=seen.to(query.device), scale=scale).transpose(0, 1)
            continue
        q = query[own].transpose(0, 1).float()
        s = (q @ keys.float().transpose(1, 2)) * (scale if scale is not None else q.shape[-1] ** -0.5)
        s = s.masked_fill(~seen.to(query.device), float("-inf"))
        p = (s - s.amax(-1, keepdim=True)).exp()
        out[own] = ((p.to(p_dtype).float() @ values.float()) / p.sum(-1, keepdim=True)).transpose(0, 1).to(out.dtype)
    return out
