"""Who runs next: admission under the sequence and KV limits, and chunked prefill.

Sequences wait in arrival order until a slot fits the KV budget beside the running ones
(never an out-of-memory crash: admission waits; a request that could never fit is refused
naming both numbers). A request marked `isolate` runs alone: it waits for the running
sequences to finish, and nothing joins it until it ends. Prefill is chunked: each step computes at most `prefill_chunk` prompt
tokens in all, alongside every decoding sequence's rows, so one long document never stalls
the others for its whole prompt. A prompt's shared prefix (instruction + schema) is taken
from the prefix cache when there; when several admitted sequences share a prefix that is not
cached yet, the first computes it and the others wait for it instead of computing it again.
A prefix not cached starts from the longest start of it that a cached one shares (the
instruction, and the first fields where another schema begins with the same ones).
"""

from __future__ import annotations

from collections import deque

from structspec.engine.kv_cache import KVCache
from structspec.engine.sequence import Phase, Sequence

MIN_PREFIX_TOKENS = 16  # a shorter shared prefix is not worth a cache entry


class RequestTooLarge(ValueError):
    """The request's KV can never fit the engine's budget."""


class Scheduler:
    def __init__(self, kv: KVCache, max_seqs: int, prefill_chunk: int, context_len: int, prefix_reuse: bool):
        self.kv = kv
        self.max_seqs = max_seqs
        self.prefill_chunk = prefill_chunk
        self.context_len = context_len
        self.prefix_reuse = prefix_reuse
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._computing: dict[tuple[int, ...], str] = {}  # prefix key -> id of the sequence computing it

    def __len__(self) -> int:
        return len(self.waiting) + len(self.running)

    def add(self, seq: Sequence) -> None:
        cap = seq.capacity(self.context_len)
        if not self.kv.fits_ever(cap):
            mib = 1024 * 1024
            raise RequestTooLarge(
                f"this request needs {self.kv.bytes_for(cap) / mib:.1f} MiB of KV cache ({cap} tokens: the prompt's "
                f"{len(seq.prompt)} plus max_tokens {seq.max_tokens}, at most the model's context) but the engine's "
                f"KV budget is {self.kv.budget_bytes / mib:.1f} MiB (STRUCTSPEC_ENGINE_KV_BUDGET_MB); lower "
                "max_tokens or raise the budget")
        self.waiting.append(seq)

    # --- admission -------------------------------------------------------------------------

    def admit(self) -> list[Sequence]:
        """Give waiting sequences a slot while sequences and budget allow (arrival order). An
        `isolate` request waits for the running ones to finish, then runs alone."""
        admitted = []
        while self.waiting and len(self.running) < self.max_seqs:
            seq = self.waiting[0]
            if self.running and (seq.request.isolate or self.running[0].request.isolate):
                break
            slot = self.kv.allocate(seq.capacity(self.context_len))
            if slot is None:
                break  # the budget is full of running sequences: wait for one to finish
            self.waiting.popleft()
            seq.slot, seq.phase = slot, Phase.PREFILL
            self.running.append(seq)
            self._take_prefix(seq)
            admitted.append(seq)
        return admitted

    def prefix_key(self, seq: Sequence) -> tuple[int, ...] | None:
        if not self.prefix_reuse or seq.prefix_len < MIN_PREFIX_TOKENS:
            return None
        return tuple(seq.prompt[:seq.prefix_len])

    def _take_prefix(self, seq: Sequence) -> None:
        """Copy `seq`'s prefix from the cache when there; else the longest start of it that a
        cached entry shares (another schema's prompt with the same instruction and first
        fields), once, before it computes anything."""
        key = self.prefix_key(seq)
        if key is None or seq.cached >= seq.prefix_len or (seq.cached and seq.stats.prefix_tokens != seq.cached):
            return  # nothing to take, or it has computed part of its prompt itself
        entry = self.kv.prefix.get(key)
        if entry is not None:
            seq.slot.copy_prefix_from(entry)
            self.kv.prefix.reused_tokens += entry.length - seq.cached
            seq.cached = entry.length
            seq.stats.prefix_tokens = entry.length
            self.kv.prefix.hits += 1
            self._maybe_decode(seq)
            return
        if key not in self._computing:
            self._computing[key] = seq.id
            self.kv.prefix.misses += 1
        if not seq.cached:
            start, n = self.kv.prefix.longest_start(key)
            # at least its last prefix token is computed here, so that the prefix reaches its end in
            # `prefilled` (where the sequence computing it keeps it)
            n = min(n, seq.prefix_len - 1, seq.prefill_target - 1)
            if n >= MIN_PREFIX_TOKENS:
                seq.slot.copy_prefix_from(start, n)
                seq.cached = seq.stats.prefix_tokens = n
                self.kv.prefix.reused_tokens += n

    # --- prefill ---------------------------------------------------------------------------

    def prefill_work(self) -> list[tuple[Sequence, int]]:
        """(sequence, prompt tokens to compute this step), at most prefill_chunk in all."""
        left, work = self.prefill_chunk, []
        for seq in self.running:
            if left <= 0:
                break
            if seq.phase is not Phase.PREFILL or seq.cancelled:
                continue
            key = self.prefix_key(seq)
            if key is not None and seq.cached < seq.prefix_len:
                self._take_prefix(seq)  # cached meanwhile by the sequence computing it?
                owner = self._computing.get(key)
                if owner is not None and owner != seq.id:
                    continue  # wait for it
                if seq.phase is not Phase.PREFILL:
                    continue
            n = min(seq.prefill_target - seq.cached, left)
            if key is not None and seq.cached < seq.prefix_len and self._computing.get(key) == seq.id:
                n = min(n, seq.prefix_len - seq.cached)  # stop at the prefix's end to keep it
            if n > 0:
                work.append((seq, n))
                left -= n
        return work

    def prefilled(self, seq: Sequence, n: int) -> None:
        """`n` more prompt tokens of `seq` are in its slot."""
        seq.cached += n
        seq.stats.prefill_tokens += n
        key = self.prefix_key(seq)
        if key is not None and seq.cached == seq.prefix_len and self._computing.get(key) == seq.id:
            self.kv.remember_prefix(key, seq.slot)
            del self._computing[key]
        self._maybe_decode(seq)

    def _maybe_decode(self, seq: Sequence) -> None:
        if seq.cached >= seq.prefill_target:
            seq.phase = Phase.DECODE

    # --- decode and retirement -------------------------------------------------------------

    def decoding(self) -> list[Sequence]:
        return [s for s in self.running if s.phase is Phase.DECODE and not s.cancelled]

    def retire(self, seq: Sequence) -> None:
        """Free `seq`'s slot; a prefix it was computing is left to the next sequence needing it."""
        if seq in self.running:
            self.running.remove(seq)
            self.kv.release(seq.slot)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        for key, owner in list(self._computing.items()):
            if owner == seq.id:
                del self._computing[key]
        seq.phase = Phase.DONE

    def find(self, request_id: str) -> Sequence | None:
        for seq in (*self.running, *self.waiting):
            if seq.id == request_id:
                return seq
        return None
