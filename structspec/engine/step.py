"""One engine step, as small functions in the order they run.

    propose   -> every decoding sequence's draft (up to its k), cut at the first
                 grammar-invalid token; drafts of `auto` sequences are then trimmed to
                 what pays in this batch (cost.py, in Engine._draft)
    pack      -> bitmask rows in one shared buffer (row i = what the grammar allows after
                 draft[:i]) and the packed rows [last, draft...] of every sequence plus this
                 step's prefill chunks
    forward   -> ONE target pass over all rows (runner.py)
    verify    -> ONE verification for the batch (kernels/), one host synchronisation
    commit    -> per sequence: accept, roll grammar and KV back, check stop conditions

With an empty draft a sequence does plain constrained decoding, so `none` runs the same lean
path as the speculative strategies.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from structspec import kernels
from structspec.engine.kv_cache import Segment
from structspec.engine.runner import StepInputs
from structspec.engine.sequence import Sequence
from structspec.kernels.greedy import accept_targets

log = logging.getLogger(__name__)


class GrammarDeadEnd(RuntimeError):
    """The grammar allows no token at some position (a backend bug, never expected)."""


@dataclass
class Packed:
    """What a step's verification needs besides the logits (vLLM's SpecDecodeMetadata, ours).

    decoding[b] owns logits rows [cu[b] + b, cu[b + 1] + b]; drafts packs their drafts."""

    inputs: StepInputs
    decoding: list[Sequence]
    drafts: torch.Tensor  # [sum n_b] int64
    cu: torch.Tensor  # [B + 1] int32
    cu_list: list[int]  # the same offsets on the host
    rows: int  # logits rows (= bitmask rows) in use
    prefill_rows: int


def propose(seq: Sequence) -> None:
    """seq.draft := up to seq.k proposed tokens, cut at the first control token (proposers
    encode text as plain text and never draft one; an injected proposer might) and at the
    first one the grammar refuses."""
    seq.ctx.confidence = []  # the proposer notes how sure it is of what it drafts now
    if seq.k <= 0:
        seq.draft = []
        return
    seq.ctx.output_text = seq.out_bytes.decode("utf-8", errors="replace")
    draft = seq.proposer.propose(seq.ctx, seq.k)[:seq.k]
    special = seq.ctx.tokens.special
    draft = draft[:next((i for i, t in enumerate(draft) if t in special), len(draft))]
    seq.draft = draft[:seq.matcher.validate(draft)] if draft else []


def fill_bitmask(seq: Sequence, bitmask: torch.Tensor, first_row: int) -> None:
    """Rows first_row..first_row + n of `bitmask`; leaves the matcher advanced over the draft
    (commit rolls back what verification rejects)."""
    n = len(seq.draft)
    for i in range(n + 1):
        seq.matcher.fill_bitmask(bitmask, first_row + i)
        if i < n and not seq.matcher.consume(seq.draft[i:i + 1]):
            raise GrammarDeadEnd(f"grammar refused a validated draft token: {seq.matcher.error()}")


def pack(prefill: list[tuple[Sequence, int]], decoding: list[Sequence], device: torch.device) -> Packed:
    """Packed rows: decoding sequences' [last, draft...] first (their logits rows are then the
    leading rows, in kernel order), then prefill chunks (no logits)."""
    ids: list[int] = []
    positions: list[int] = []
    segments: list[Segment] = []
    drafts: list[int] = []
    cu = [0]
    for seq in decoding:
        rows = [seq.last] + seq.draft
        segments.append(Segment(seq.slot, len(ids), len(rows), seq.cached))
        positions += range(seq.cached, seq.cached + len(rows))
        ids += rows
        drafts += seq.draft
        cu.append(len(drafts))
    logits_rows = len(ids)
    for seq, n in prefill:
        segments.append(Segment(seq.slot, len(ids), n, seq.cached))
        ids += seq.prompt[seq.cached:seq.cached + n]
        positions += range(seq.cached, seq.cached + n)
    inputs = StepInputs(
        input_ids=torch.tensor(ids, dtype=torch.long).to(device, non_blocking=True),
        positions=torch.tensor(positions, dtype=torch.long).to(device, non_blocking=True),
        segments=segments,
        logits_rows=torch.arange(logits_rows, device=device))
    return Packed(inputs, decoding, torch.tensor(drafts, dtype=torch.int64).to(device, non_blocking=True),
                  torch.tensor(cu, dtype=torch.int32).to(device, non_blocking=True), cu, logits_rows,
                  len(ids) - logits_rows)


def verify(logits: torch.Tensor, bitmask: torch.Tensor, packed: Packed, vocab_size: int,
           backend: str, native=None) -> list[list[int]]:
    """Per decoding sequence: accepted draft prefix + correction/bonus token (one host sync).

    Greedy and sampled sequences share the step: when both are present, each group is
    verified by its own kernel over its own rows (two launches, one synchronisation). With
    `native` (kernels.cpu_layer.LayerOps, on a CPU) a greedy-only step takes its masked argmax
    from C, the same tokens as kernels' torch reference in a fraction of its time."""
    seqs = packed.decoding
    sampled = [b for b, s in enumerate(seqs) if s.temperature > 0]
    if not sampled:
        if native is not None:
            target, _ = native.masked_argmax(logits, bitmask)
            longest = max(b - a for a, b in zip(packed.cu_list, packed.cu_list[1:]))
            return _rows(*accept_targets(target, packed.drafts, packed.cu, longest))
        tokens, num = kernels.verify_greedy(logits, bitmask, packed.drafts, packed.cu, backend=backend)
        return _rows(tokens, num)
    if len(sampled) == len(seqs):
        return _rows(*_verify_sampled(logits, bitmask, packed, list(range(len(seqs))), vocab_size, backend))
    greedy = [b for b in range(len(seqs)) if seqs[b].temperature <= 0]
    sub_g = _subset(logits, bitmask, packed, greedy)
    g_tokens, g_num = kernels.verify_greedy(*sub_g, backend=backend)
    s_tokens, s_num = _verify_sampled(logits, bitmask, packed, sampled, vocab_size, backend)
    out: list[list[int]] = [[] for _ in seqs]
    for b, row in zip(greedy, _rows(g_tokens, g_num)):
        out[b] = row
    for b, row in zip(sampled, _rows(s_tokens, s_num)):
        out[b] = row
    return out


def native_verifier(kernel_backend: str, device: torch.device, cache_dir):
    """kernels.cpu_layer's library for verify and emitted_probs on a CPU under kernel_backend
    "auto"; None elsewhere (kernels' Triton or torch verification), and when it cannot be built
    (logged; the torch reference verifies then)."""
    if kernel_backend != "auto" or device.type != "cpu":
        return None
    try:
        from structspec.kernels.cpu_layer import load

        return load(cache_dir)
    except Exception as e:  # no compiler, a failed build
        log.warning("the native greedy verification is unavailable (%s); verifying in torch", e)
        return None


def _rows(tokens: torch.Tensor, num: torch.Tensor) -> list[list[int]]:
    both = torch.cat([tokens, num.unsqueeze(1).to(tokens.dtype)], dim=1).tolist()  # the step's one sync
    return [row[:row[-1] + 1] for row in both]


def _subset(logits, bitmask, packed: Packed, which: list[int]):
    """(logits, bitmask, drafts, cu) of sequences `which`, in kernel layout."""
    cu = packed.cu_list
    rows, draft_idx, new_cu = [], [], [0]
    for b in which:
        rows += range(cu[b] + b, cu[b + 1] + b + 1)
        draft_idx += range(cu[b], cu[b + 1])
        new_cu.append(new_cu[-1] + cu[b + 1] - cu[b])
    dev = logits.device
    r = torch.tensor(rows, dtype=torch.long, device=dev)
    d = torch.tensor(draft_idx, dtype=torch.long, device=dev)
    return logits[r], bitmask[r], packed.drafts[d], torch.tensor(new_cu, dtype=torch.int32, device=dev)


def _verify_sampled(logits, bitmask, packed: Packed, which: list[int], vocab_size: int, backend: str):
    seqs = packed.decoding
    if len(which) == len(seqs):
        sub = (logits, bitmask, packed.drafts, packed.cu)
    else:
        sub = _subset(logits, bitmask, packed, which)
    dev = logits.device
    accept_u, noise = kernels.make_sampling_randoms(sub[3], vocab_size, [seqs[b].generator for b in which], dev)
    temps = torch.tensor([seqs[b].temperature for b in which], dtype=torch.float32, device=dev)
    return kernels.verify_sampling(*sub, temps, accept_u, noise, backend=backend)


def masked_rows(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor | slice) -> torch.Tensor:
    """The logits of `rows` in float32 with every token the grammar disallows at -inf."""
    from structspec.kernels.bitmask import unpack_bitmask

    if isinstance(rows, slice):
        x, words = logits[rows], bitmask[rows]
    else:
        x, words = logits.index_select(0, rows), bitmask.index_select(0, rows)
    x = x.float()
    return x.masked_fill(~unpack_bitmask(words, x.shape[1]), float("-inf"))


def margins(logits: torch.Tensor, bitmask: torch.Tensor, first_row: int,
            count: int) -> tuple[list[float], list[float]]:
    """Top-2 masked logit gap of `count` rows (inf where one token is allowed), and each row's
    top masked logit (a gap is judged against the rounding of a logit that size)."""
    x = masked_rows(logits, bitmask, slice(first_row, first_row + count))
    top = x.topk(2, dim=-1).values
    return (top[:, 0] - top[:, 1]).tolist(), top[:, 0].tolist()


def emitted_probs(logits: torch.Tensor, bitmask: torch.Tensor, packed: Packed,
                  emitted: list[list[int]], native=None) -> list[list[float]]:
    """Per decoding sequence, the probability the target gave each emitted token under the
    grammar's mask at temperature 1 (grounding.py's confidence): one gather over the rows the
    tokens were verified at, one host sync. With `native` (as in verify) the masked softmax's
    normaliser comes from C in one pass per row (NaN logits left out of it, where torch's sum
    turns NaN)."""
    rows, tokens = [], []
    for b, out in enumerate(emitted):
        first = packed.cu_list[b] + b
        rows.extend(range(first, first + len(out)))
        tokens.extend(max(t, 0) for t in out)  # -1: a grammar dead end, whose sequence fails anyway
    if not rows:
        return [[] for _ in emitted]
    rows_t, tokens_t = torch.tensor(rows, device=logits.device), torch.tensor(tokens, device=logits.device)
    if native is not None:
        _, logz = native.masked_argmax(logits, bitmask, rows_t, logz=True)
        allowed = (bitmask[rows_t, tokens_t // 32] >> (tokens_t % 32)) & 1 == 1
        chosen = logits[rows_t, tokens_t].float().masked_fill(~allowed, float("-inf"))
        flat = (chosen - logz).exp().tolist()
    else:
        x = masked_rows(logits, bitmask, rows_t)
        chosen = x.gather(1, tokens_t.unsqueeze(1)).squeeze(1)
        flat = (chosen - torch.logsumexp(x, dim=-1)).exp().tolist()
    out, at = [], 0
    for row in emitted:
        out.append(flat[at:at + len(row)])
        at += len(row)
    return out


def guard_loops(seq: Sequence, token_bytes) -> None:
    """Apply the loop guard (engine/loopguard.py) to the tokens this step added: an output that
    repeats itself is cut where the rule first holds and stops with reason `repetition`."""
    if seq.loop_guard is None:
        return
    end = seq.loop_guard.feed(seq.out, token_bytes)
    if end is None or (end == len(seq.out) and seq.stop_reason in ("grammar", "eos")):
        return
    if end < len(seq.out):
        del seq.out[end:]
        seq.out_bytes = bytearray(token_bytes(seq.out))
    seq.stop_reason = "repetition"


def commit(seq: Sequence, emitted: list[int], eos_ids: set[int], token_bytes, batch_size: int) -> None:
    """Apply one verification result: `emitted` = accepted draft prefix + correction/bonus."""
    n = len(seq.draft)
    accepted = len(emitted) - 1
    correction = emitted[-1]
    # An accepted draft token that is EOS ends the output exactly as a verified EOS would (only
    # an EOS id that is not a control token can get here: propose cuts drafts at those).
    eos_at = next((i for i, t in enumerate(seq.draft[:accepted]) if t in eos_ids), None)
    keep = accepted if eos_at is None else eos_at
    seq.matcher.rollback(n - keep)
    seq.slot.rollback(n - keep)  # the forward pass stored [last, draft...]: keep last + draft[:keep]
    seq.cached += keep + 1
    seq.stats.record_step(seq.k, n, accepted, batch_size)
    seq.out += seq.draft[:keep]
    seq.out_bytes += token_bytes(seq.draft[:keep])
    if eos_at is not None:
        seq.stop_reason = "eos"
        return
    if correction < 0:
        raise GrammarDeadEnd("the grammar allows no token here" + (f": {seq.matcher.error()}"
                                                                   if seq.matcher.error() else ""))
    if correction in eos_ids and seq.matcher.is_accepting():
        seq.stop_reason = "eos"
        return
    if not seq.matcher.consume([correction]):
        raise GrammarDeadEnd(f"grammar refused the verified token {correction}: {seq.matcher.error()}")
    seq.out.append(correction)
    seq.out_bytes += token_bytes([correction])
    seq.last = correction
    if seq.matcher.is_stopped():
        seq.stop_reason = "grammar"
    elif seq.budget <= 0:
        seq.stop_reason = "max_tokens"
    elif seq.cached + 1 > seq.slot.capacity:
        seq.stop_reason = "context"
