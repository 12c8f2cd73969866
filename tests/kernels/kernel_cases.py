"""Builders for ragged verification batches and plain-Python oracles.

The oracles loop over tokens one by one with Python floats (float64) so they
are obviously correct; they check the torch references, which in turn are
the exact oracle for the Triton kernels.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

import torch

LOGIT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# Where the kernels' inputs go: the CPU (the interpreter), or with STRUCTSPEC_KERNEL_TESTS=cuda
# (conftest.py: compiled kernels) the GPU. Batches are built on the CPU and moved by the tests'
# run helpers, so the oracles and generators stay on the CPU.
DEVICE = torch.device("cuda" if os.environ.get("STRUCTSPEC_KERNEL_TESTS") == "cuda" else "cpu")


def _cpuinfo(field: str) -> str:
    """The first value of `field` in /proc/cpuinfo ("" where there is none)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(field):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


CPU_FLAGS = frozenset(_cpuinfo("flags").split())  # this CPU's features, for the native kernels' tests
CPU_VENDOR = _cpuinfo("vendor_id")  # GenuineIntel, AuthenticAMD


def on_device(tensors) -> list:
    """`tensors` (None kept) moved to DEVICE."""
    return [t.to(DEVICE) if isinstance(t, torch.Tensor) else t for t in tensors]


def cu_from_lengths(lengths: list[int]) -> torch.Tensor:
    """int32 [B + 1] offsets for the given draft lengths."""
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    return torch.tensor(cu, dtype=torch.int32)


def pack_bitmask(allowed: torch.Tensor) -> torch.Tensor:
    """bool [N, V] -> int32 [N, ceil(V / 32)] with bit t % 32 of word t // 32 = allowed[t]."""
    num_rows, vocab = allowed.shape
    words = (vocab + 31) // 32
    padded = torch.zeros(num_rows, words * 32, dtype=torch.int64)
    padded[:, :vocab] = allowed.to(torch.int64)
    packed = (padded.view(num_rows, words, 32) << torch.arange(32)).sum(-1)
    # Reinterpret the unsigned 32-bit pattern as int32.
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)


def row_ranges(lengths: list[int]) -> list[range]:
    """Packed logits rows of each sequence (n_b draft rows + the bonus row)."""
    out, start = [], 0
    for n in lengths:
        out.append(range(start, start + n + 1))
        start += n + 1
    return out


@dataclass
class Batch:
    """One ragged verification batch (CPU tensors)."""

    lengths: list[int]
    logits: torch.Tensor
    allowed: torch.Tensor  # bool [N, V], the unpacked bitmask
    bitmask: torch.Tensor
    draft_tokens: torch.Tensor
    cu_num_draft: torch.Tensor

    @property
    def args(self) -> tuple[torch.Tensor, ...]:
        return (self.logits, self.bitmask, self.draft_tokens, self.cu_num_draft)


def random_batch(
    gen: torch.Generator,
    lengths: list[int],
    vocab: int,
    *,
    dtype: torch.dtype = torch.float32,
    density: float = 0.5,
    logit_levels: int | None = None,
    draft_from_target: float = 0.7,
    token_dtype: torch.dtype = torch.int64,
) -> Batch:
    """A random batch.  ``logit_levels`` draws integer logits in [0, levels) (many ties);
    ``draft_from_target`` is the chance a draft copies the row's masked argmax (so
    that drafts are often accepted) rather than being uniform over the vocab."""
    num_rows = sum(lengths) + len(lengths)
    if logit_levels is None:
        logits = torch.randn(num_rows, vocab, generator=gen) * 3
    else:
        logits = torch.randint(0, logit_levels, (num_rows, vocab), generator=gen).float()
    logits = logits.to(dtype)
    allowed = torch.rand(num_rows, vocab, generator=gen) < density
    # Keep at least one allowed token per row unless density is 0.
    if density > 0:
        allowed[torch.arange(num_rows), torch.randint(0, vocab, (num_rows,), generator=gen)] = True
    masked = logits.float().masked_fill(~allowed, float("-inf"))
    target = masked.argmax(-1)
    drafts = []
    for b, rows in enumerate(row_ranges(lengths)):
        for j in range(lengths[b]):
            if torch.rand(1, generator=gen).item() < draft_from_target:
                drafts.append(int(target[rows[j]]))
            else:
                drafts.append(int(torch.randint(0, vocab, (1,), generator=gen)))
    draft_tokens = torch.tensor(drafts, dtype=token_dtype)
    return Batch(lengths, logits, allowed, pack_bitmask(allowed), draft_tokens, cu_from_lengths(lengths))


# ---------------------------------------------------------------------------
# Plain-Python oracles
# ---------------------------------------------------------------------------


def _usable(logit_row: list[float], allowed_row: list[bool]) -> list[int]:
    return [t for t, (x, ok) in enumerate(zip(logit_row, allowed_row)) if ok and x > -math.inf and x == x]


def oracle_greedy(batch: Batch) -> tuple[list[list[int]], list[int]]:
    """Per sequence: accepted prefix + correction/bonus token, and the accepted count."""
    logits = batch.logits.float().tolist()
    allowed = batch.allowed.tolist()
    drafts = batch.draft_tokens.tolist()
    outputs, counts = [], []
    d = 0
    for n, rows in zip(batch.lengths, row_ranges(batch.lengths)):
        out = []
        for j, r in enumerate(rows):
            usable = _usable(logits[r], allowed[r])
            target = -1
            for t in usable:  # increasing t, strict > keeps the lowest id on ties
                if target < 0 or logits[r][t] > logits[r][target]:
                    target = t
            out.append(target)
            if j == n or drafts[d + j] != target or target < 0:
                break
        outputs.append(out)
        counts.append(len(out) - 1)
        d += n
    return outputs, counts


def oracle_probs(logit_row: list[float], allowed_row: list[bool], temperature: float) -> list[float]:
    """Masked softmax(logits / T) in float64."""
    usable = _usable(logit_row, allowed_row)
    p = [0.0] * len(logit_row)
    if not usable:
        return p
    m = max(logit_row[t] / temperature for t in usable)
    weights = {t: math.exp(logit_row[t] / temperature - m) for t in usable}
    total = sum(weights.values())
    for t, w in weights.items():
        p[t] = w / total
    return p


def oracle_race(weights: list[float], noise: list[float]) -> int:
    """argmax_t weights[t] / noise[t] over weights[t] > 0, lowest t on ties; -1 if none."""
    best, best_score = -1, -1.0
    for t, (w, e) in enumerate(zip(weights, noise)):
        if w > 0 and w / e > best_score:
            best, best_score = t, w / e
    return best


def oracle_sampling(
    batch: Batch,
    temperature: torch.Tensor,
    accept_uniform: torch.Tensor,
    sample_noise: torch.Tensor,
    draft_probs: torch.Tensor | None,
) -> tuple[list[list[int]], list[int]]:
    """Leviathan et al. rejection sampling, token by token, in float64."""
    logits = batch.logits.float().tolist()
    allowed = batch.allowed.tolist()
    drafts = batch.draft_tokens.tolist()
    uniforms = accept_uniform.tolist()
    noise = sample_noise.tolist()
    q_rows = None if draft_probs is None else draft_probs.tolist()
    outputs, counts = [], []
    d = 0
    for b, (n, rows) in enumerate(zip(batch.lengths, row_ranges(batch.lengths))):
        out = []
        for j, r in enumerate(rows):
            p = oracle_probs(logits[r], allowed[r], float(temperature[b]))
            if j == n:  # bonus row
                out.append(oracle_race(p, noise[b]))
                break
            x = drafts[d + j]
            q = [0.0] * len(p)
            if q_rows is None:
                q[x] = 1.0
            else:
                q = q_rows[d + j]
            if p[x] > 0 and uniforms[d + j] <= min(1.0, p[x] / q[x] if q[x] > 0 else math.inf):
                out.append(x)
                continue
            residual = [max(pt - qt, 0.0) for pt, qt in zip(p, q)]
            token = oracle_race(residual, noise[b])  # one noise row per sequence
            out.append(token if token >= 0 else oracle_race(p, noise[b]))
            break
        outputs.append(out)
        counts.append(len(out) - 1)
        d += n
    return outputs, counts


def assert_unchanged(before: list[torch.Tensor], after: list[torch.Tensor]) -> None:
    """Inputs must come back bit for bit (NaN where NaN was)."""
    for a, b in zip(before, after, strict=True):
        torch.testing.assert_close(b, a, rtol=0, atol=0, equal_nan=True, msg="an input was modified")


def as_lists(output_tokens: torch.Tensor, num_accepted: torch.Tensor) -> tuple[list[list[int]], list[int]]:
    """Strip the -1 padding: per sequence the num_accepted + 1 valid tokens."""
    counts = num_accepted.tolist()
    rows = output_tokens.tolist()
    return [row[: k + 1] for row, k in zip(rows, counts)], counts
