"""The speculative constrained decode loop.

Each step: propose <= k draft tokens, cut the draft at the first grammar-invalid token,
run the target once over [last, draft...], mask every position with its grammar
bitmask, accept the longest matching prefix (greedy) or the rejection-sampling prefix
(temperature > 0), take the target's token at the first mismatch (or a bonus token
after a full accept), then roll grammar and KV cache back to what was accepted.

With an empty draft this is exactly plain constrained decoding, so `none` runs the same
lean code path as the speculative strategies and speedups are measured honestly.
"""

from __future__ import annotations

import copy
import secrets
import time
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

import kernels
from structspec.engine.proposers import DocumentIndex, DraftContext, Proposer
from structspec.engine.tokens import TokenText
from structspec.grammar import Matcher


class GrammarDeadEnd(RuntimeError):
    """The grammar allows no token at some position (a backend bug, never expected)."""


@dataclass
class DecodeOptions:
    draft_len: int = 8
    temperature: float = 0.0
    seed: int | None = None
    max_tokens: int = 1024
    kernel_backend: str = "auto"
    verbatim: bool = False  # the grammar limits some string values to document spans (a drafting hint)


@dataclass
class DecodeStats:
    output_tokens: int = 0
    target_passes: int = 0  # forward passes after prefill
    proposed: int = 0  # draft tokens sent to verification (after the grammar cut)
    accepted: int = 0
    proposed_by_position: list[int] = field(default_factory=list)
    accepted_by_position: list[int] = field(default_factory=list)
    prefill_s: float = 0.0
    decode_s: float = 0.0

    def record_step(self, proposed: int, accepted: int) -> None:
        self.target_passes += 1
        self.proposed += proposed
        self.accepted += accepted
        grow = proposed - len(self.proposed_by_position)
        if grow > 0:
            self.proposed_by_position += [0] * grow
            self.accepted_by_position += [0] * grow
        for i in range(proposed):
            self.proposed_by_position[i] += 1
            if i < accepted:
                self.accepted_by_position[i] += 1

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0

    @property
    def tokens_per_pass(self) -> float:
        return self.output_tokens / self.target_passes if self.target_passes else 0.0


@dataclass
class DecodeOutput:
    tokens: list[int]
    finished: bool  # the grammar completed (or EOS in an accepting state)
    stop_reason: str  # "grammar" | "eos" | "max_tokens" | "context"
    stats: DecodeStats


class Decoder:
    """Owns nothing per request; safe to reuse for many requests (not concurrently)."""

    def __init__(self, model: torch.nn.Module, vocab_size: int, eos_token_ids: set[int],
                 token_text: TokenText, context_len: int):
        self.model = model
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self.token_text = token_text
        self.context_len = context_len
        self.device = next(model.parameters()).device
        # Benchmarks run one document under many strategies: with memo_prefill on, the
        # last prompt's KV cache is kept and copied for the same prompt (prefill is identical).
        self.memo_prefill = False
        self._memo: tuple[tuple[int, ...], DynamicCache] | None = None

    @torch.inference_mode()
    def forward(self, tokens: list[int], cache: DynamicCache) -> torch.Tensor:
        """Logits [len(tokens), V] for `tokens` appended to `cache` (which grows)."""
        ids = torch.tensor([tokens], dtype=torch.long, device=self.device)
        out = self.model(input_ids=ids, past_key_values=cache, use_cache=True)
        return out.logits[0]

    @torch.inference_mode()
    def prefill(self, prompt: list[int]) -> DynamicCache:
        """Cache of every prompt token but the last, which the first step feeds."""
        key = tuple(prompt[:-1])
        if self._memo is not None and self._memo[0] == key:
            return copy.deepcopy(self._memo[1])
        cache = DynamicCache(config=self.model.config)
        if len(prompt) > 1:
            ids = torch.tensor([prompt[:-1]], dtype=torch.long, device=self.device)
            # Only the cache is needed: logits for every prompt position would be [~2k, V] floats
            # (~400 MB at V=49k) and a matmul as large as the rest of the prefill on a CPU.
            self.model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
        self._memo = (key, copy.deepcopy(cache)) if self.memo_prefill else None
        return cache

    def run(self, prompt: list[int], matcher: Matcher, proposer: Proposer, document: str,
            opts: DecodeOptions) -> DecodeOutput:
        if not prompt:
            raise ValueError("empty prompt")
        stats = DecodeStats()
        t0 = time.perf_counter()
        cache = self.prefill(prompt)
        stats.prefill_s = time.perf_counter() - t0

        t1 = time.perf_counter()
        ctx = DraftContext(matcher=matcher, output_text="", document=DocumentIndex(document),
                           tokens=self.token_text, verbatim=opts.verbatim)
        generator = None
        if opts.temperature > 0:
            generator = torch.Generator(device=self.device)
            # No seed: draw one from the OS (torch.seed() would reseed the global RNG).
            generator.manual_seed(opts.seed if opts.seed is not None else secrets.randbits(63))
        bitmask = torch.zeros((opts.draft_len + 1, (self.vocab_size + 31) // 32), dtype=torch.int32)
        out: list[int] = []
        out_bytes = bytearray()
        last = prompt[-1]
        cached = len(prompt) - 1  # tokens in the KV cache
        stop = None
        while stop is None:
            budget = opts.max_tokens - len(out)
            room = self.context_len - cached - 1  # positions left for [last, draft...]
            if budget <= 0:
                stop = "max_tokens"
                break
            if room < 1:
                stop = "context"
                break
            # Drafts never overrun max_tokens or the context: accepted + 1 <= budget.
            k = max(0, min(opts.draft_len, budget - 1, room - 1))
            ctx.output_text = out_bytes.decode("utf-8", errors="replace")
            draft = proposer.propose(ctx, k)[:k] if k else []
            draft = draft[:matcher.validate(draft)]
            n = len(draft)

            # Bitmask row i = what the grammar allows after draft[:i].
            for i in range(n + 1):
                matcher.fill_bitmask(bitmask, i)
                if i < n and not matcher.consume(draft[i:i + 1]):
                    raise GrammarDeadEnd(f"grammar refused a validated draft token: {matcher.error()}")
            logits = self.forward([last] + draft, cache)  # [n+1, V]
            new_tokens, accepted = self.verify(logits, bitmask[:n + 1], draft, opts, generator)
            correction = new_tokens[-1]
            if correction < 0:
                raise GrammarDeadEnd("the grammar allows no token here")

            # Roll grammar and cache back to [.., last, draft[:accepted]].
            matcher.rollback(n - accepted)
            cache.crop(-(n - accepted))
            cached += accepted + 1
            stats.record_step(n, accepted)
            out += draft[:accepted]
            out_bytes += self.token_text.bytes_of(draft[:accepted])

            if correction in self.eos_token_ids and matcher.is_accepting():
                stop = "eos"
                break
            if not matcher.consume([correction]):
                raise GrammarDeadEnd(f"grammar refused the verified token {correction}: {matcher.error()}")
            out.append(correction)
            out_bytes += self.token_text.bytes_of([correction])
            last = correction
            if matcher.is_stopped():
                stop = "grammar"
        stats.output_tokens = len(out)
        stats.decode_s = time.perf_counter() - t1
        return DecodeOutput(tokens=out, finished=stop in ("grammar", "eos"), stop_reason=stop, stats=stats)

    def verify(self, logits: torch.Tensor, bitmask: torch.Tensor, draft: list[int],
               opts: DecodeOptions, generator: torch.Generator | None) -> tuple[list[int], int]:
        """(accepted draft prefix + correction/bonus token, number accepted)."""
        dev = logits.device
        draft_t = torch.tensor(draft, dtype=torch.int64, device=dev)
        cu = torch.tensor([0, len(draft)], dtype=torch.int32, device=dev)
        bm = bitmask.to(dev, non_blocking=True)
        if opts.temperature <= 0:
            tokens, num = kernels.verify_greedy(logits, bm, draft_t, cu, backend=opts.kernel_backend)
        else:
            accept_u, noise = kernels.make_sampling_randoms(cu, logits.shape[-1], [generator], dev)
            temp = torch.full((1,), opts.temperature, dtype=torch.float32, device=dev)
            tokens, num = kernels.verify_sampling(logits, bm, draft_t, cu, temp, accept_u, noise,
                                                  backend=opts.kernel_backend)
        accepted = int(num[0])
        return tokens[0, :accepted + 1].tolist(), accepted
