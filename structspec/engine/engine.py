"""The engine: schema + document -> JSON guaranteed to match the schema, many documents at once.

    engine = Engine.from_settings(settings)
    engine.submit(Request(schema, document, options))   # any number, any time
    while engine.has_work():
        for result in engine.step(): ...                 # finished requests of this step

`run(requests)` and `extract(schema, document, options)` wrap that loop. One thread steps an
engine (the worker's engine loop, the CLI); `cancel` may be called from the same thread.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import secrets
import time
import traceback
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import torch

from structspec import kernels
from structspec.config import Settings
from structspec.engine.grounding import confidences, find_spans
from structspec.engine.cost import EXPLORE_EVERY, PassCostCurve, choose_draft_lens
from structspec.engine.kv_cache import KVCache
from structspec.engine.model import LoadedModel, load_model
from structspec.engine.prompt import build_chat_prompt, build_prompt
from structspec.engine.proposers import DocumentIndex, DraftContext, History, SuffixStore, make_proposer
from structspec.engine.packed import PackedLinear, native_linear, pack_linears, unpack_linears
from structspec.engine.runner import make_runner
from structspec.engine.scheduler import RequestTooLarge, Scheduler
from structspec.engine.sequence import ExtractResult, Phase, Request, RequestStats, Sequence
from structspec.engine.step import (GrammarDeadEnd, commit, emitted_probs, fill_bitmask, guard_loops, margins,
                                    native_verifier, pack, propose, verify)
from structspec.engine.tokens import token_text
from structspec.grammar import GrammarCache, GrammarLimits, make_backend, schema_hash, validate_instance
from structspec.grammar.limits import limit_setting
from structspec.logs import preview
from structspec.options import SPECS, RequestOptions, timeout_error

log = logging.getLogger(__name__)

MiB = 1024 * 1024
MAX_DRAFT = int(SPECS["draft_len"].maximum)  # bitmask rows per sequence are MAX_DRAFT + 1

__all__ = ["Engine", "EngineMetrics", "ExtractResult", "Request", "RequestStats", "RequestTooLarge"]


@dataclass
class EngineMetrics:
    """Totals over the engine's life (benchmarks and the overhead profile read them)."""

    steps: int = 0
    decode_steps: int = 0  # steps with at least one decoding sequence
    rows: int = 0  # rows of every forward pass
    prefill_rows: int = 0
    step_s: float = 0.0  # whole steps: scheduling, proposing, masks, forward, verification, commit
    forward_s: float = 0.0  # the target model's forward passes
    verify_s: float = 0.0
    prefill_step_s: float = 0.0  # steps that computed prefill rows

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


CPU_KV_BUDGET_MB = 2048  # the auto budget on a CPU: untouched pages of a reservation are never resident


def kv_budget_bytes(setting_mb: int, device: torch.device) -> int:
    """The KV budget: `setting_mb` when set (> 0); else 2048 MiB on a CPU, and on CUDA half the
    device memory free now (the model loaded), leaving the rest to activations and other work."""
    if setting_mb > 0:
        return setting_mb * MiB
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free // 2
    return CPU_KV_BUDGET_MB * MiB


class Engine:
    """A loaded model, its grammar machinery and the batch scheduler. Build once per process."""

    def __init__(self, loaded: LoadedModel, settings: Settings | None = None, **overrides):
        settings = dataclasses.replace(settings or Settings(), **overrides) if overrides else (settings or Settings())
        self.settings = settings
        self.loaded = loaded
        self.kernel_backend = settings.kernel_backend
        self.confidence = settings.engine_confidence
        self.pruned_logits = settings.engine_pruned_logits
        self.grammars = GrammarCache(make_backend(settings.grammar_backend, loaded.tokenizer, loaded.vocab_size,
                                                  GrammarLimits.from_settings(settings), settings.json_whitespace))
        self.token_text = token_text(loaded.tokenizer, loaded.vocab_size)
        # packed (or unpacked: another engine may have packed this model) before the runner's
        # probe, so that the probe checks the layers the engine runs
        kernel_cache = settings.cache_dir / "kernels"
        native = (native_linear(settings.kernel_backend, loaded.model, kernel_cache)
                  if settings.engine_packed_linear else None)
        self.packed_linears = pack_linears(loaded.model, native) if settings.engine_packed_linear else 0
        if not settings.engine_packed_linear:
            unpack_linears(loaded.model)
        self.runner = make_runner(loaded.model, settings.kernel_backend, lean=settings.engine_lean_forward,
                                  pack=settings.engine_packed_linear, cache_dir=kernel_cache, linear=native)
        self.native_verify = native_verifier(settings.kernel_backend, loaded.device, kernel_cache)
        lean = getattr(self.runner, "lean", None)
        if lean is not None:  # it packed its own fused layers in place of the model's
            self.packed_linears = lean.packed_linears()
        self.kv = KVCache(self.runner.layout, kv_budget_bytes(settings.engine_kv_budget_mb, loaded.device),
                          self.runner.make_slot,
                          prefix_max_bytes=settings.engine_prefix_cache_mb * MiB if self.runner.batched else 0)
        self.scheduler = Scheduler(self.kv, max(1, settings.engine_max_seqs), max(1, settings.engine_prefill_chunk),
                                   loaded.context_len,
                                   prefix_reuse=self.runner.batched and settings.engine_prefix_cache_mb > 0)
        self.cost = PassCostCurve(prior_fixed_s=settings.stats_prior_pass_ms / 1000.0,
                                  prior_row_s=settings.stats_prior_pass_ms / 1000.0 * 0.2)
        self.metrics = EngineMetrics()
        # earlier outputs per Request.history (the suffix proposer); None: that memory is off
        self.histories = (SuffixStore(settings.engine_suffix_mb * MiB, settings.engine_suffix_schema_tokens)
                          if settings.engine_suffix_mb > 0 else None)
        # True: synchronise CUDA after each forward pass, so metrics.forward_s is the pass itself
        # rather than its launch (costs the overlap; benchmarks that split a step set it)
        self.sync_timing = False
        self.device = loaded.device
        words = (loaded.vocab_size + 31) // 32
        rows = self.scheduler.max_seqs * (MAX_DRAFT + 1)
        # Masks are filled on the host; pinned, the copy to the GPU is one asynchronous transfer per step.
        self.bitmask = torch.zeros((rows, words), dtype=torch.int32, pin_memory=self.device.type == "cuda")
        self._schema_prompts: OrderedDict[str, list[int]] = OrderedDict()
        self.clock: Callable[[], float] = time.monotonic  # the requests' deadlines' (tests turn it)

    @classmethod
    def from_settings(cls, settings: Settings) -> "Engine":
        loaded = load_model(settings.model, device=settings.device, dtype=settings.dtype,
                            cache_dir=settings.cache_dir)
        return cls(loaded, settings)

    @property
    def batched(self) -> bool:
        return self.runner.batched

    @property
    def forward_name(self) -> str:
        """Which forward pass runs the model: "lean" (engine/lean.py) or "model" (its own)."""
        return "lean" if getattr(self.runner, "lean", None) is not None else "model"

    @property
    def linear(self) -> str:
        """What runs the linear layers: "native" (kernels/cpu_linear.c: bf16 with AVX512-BF16,
        on the AMX tiles where the CPU has them; fp32 on a CPU without bf16 units),
        "onednn" (prepacked, engine/packed.py), "torch" (F.linear), or "native and onednn" where
        a layer failed the native kernel's check at packing (logged)."""
        layers = [m for m in self.loaded.model.modules() if isinstance(m, PackedLinear)]
        lean = getattr(self.runner, "lean", None)
        if lean is not None:
            layers += [m for m in lean.linear_modules() if isinstance(m, PackedLinear)]
        native = sum(m.uses_native() for m in layers)
        if not layers:
            return "torch"
        return "native" if native == len(layers) else "onednn" if native == 0 else "native and onednn"

    @property
    def layer_steps(self) -> str:
        """How the lean forward runs the steps between its GEMMs: "fused" (kernels/cpu_layer.c)
        or "torch" (torch's operators; also the answer for the model's own forward)."""
        lean = getattr(self.runner, "lean", None)
        return "fused" if lean is not None and lean.ops is not None else "torch"

    @property
    def layer_loop(self) -> str:
        """Where a pass's loop over the decoder layers runs: "native" (one C call, kernels/cpu_forward.c)
        or "python" (also the answer for the model's own forward)."""
        lean = getattr(self.runner, "lean", None)
        return "native" if lean is not None and lean.loops_natively() and self.runner.attention == "native" \
            else "python"

    @property
    def verification(self) -> str:
        """What computes greedy verification's masked argmax: "native" (kernels/cpu_layer.c, on a
        CPU), "triton" or "torch" (kernels' backends; sampled sequences always go there)."""
        if self.native_verify is not None:
            return "native"
        return kernels.resolve_backend(self.kernel_backend, self.device)

    # --- requests ------------------------------------------------------------------------------

    def default_options(self) -> RequestOptions:
        """The fixed strategy of Settings with its defaults (what `extract` runs without options)."""
        return RequestOptions(strategy=self.settings.strategy).with_defaults(self.settings)

    def submit(self, request: Request) -> str:
        """Queue a request; returns its id. Raises OptionError, SchemaError, DocumentTooLong or
        RequestTooLarge for a request that cannot run (nothing is queued then)."""
        opts = request.options = request.options.with_defaults(self.settings).check(concrete=True)
        if request.deadline is None:  # before anything that may refuse it: chunks inherit it (services/chunks.py)
            request.deadline = self.clock() + opts.timeout_s
        schema, document = request.schema, request.document
        grammar = self.grammars.get_for(schema, document, opts.verbatim)
        if request.messages is None:
            prompt = build_prompt(self.loaded.tokenizer, schema, document, self.loaded.context_len)
        else:
            prompt = build_chat_prompt(self.loaded.tokenizer, request.messages, self.loaded.context_len)
        verbatim = grammar.verbatim
        matcher = grammar.matcher()
        generator = None
        if opts.temperature > 0:
            generator = torch.Generator(device=self.device)
            # No seed: draw one from the OS (torch.seed() would reseed the global RNG).
            generator.manual_seed(opts.seed if opts.seed is not None else secrets.randbits(63))
        ctx = DraftContext(matcher=matcher, output_text="", document=DocumentIndex(document),
                           tokens=self.token_text, verbatim=verbatim, history=self._history(request))
        # A request that reuses its prompt (benchmarks: one document under many strategies) keeps
        # its whole prompt in the prefix cache; the others share instruction + schema.
        if request.reuse_prompt:
            prefix_len = len(prompt) - 1
        else:  # chat messages share no known prefix
            prefix_len = self._shared_prefix_len(schema, prompt) if request.messages is None else 0
        seq = Sequence(request, prompt, prefix_len, matcher,
                       request.proposer or make_proposer(opts.strategy), ctx, generator, verbatim,
                       loop_repeats=self.settings.engine_loop_repeats,
                       loop_counting=self.settings.engine_loop_counting)
        self.scheduler.add(seq)
        return request.id

    def _history(self, request: Request) -> History | None:
        """The earlier outputs `request` drafts from, built from its seed while it holds none."""
        if self.histories is None or request.history is None:
            return None
        history = self.histories.get(request.history)
        if request.history_seed and history.outputs == 0:
            for text in request.history_seed:
                self.histories.learn(request.history, self.token_text.encode(text), text)
        return history

    def _shared_prefix_len(self, schema: dict, prompt: list[int]) -> int:
        """Leading prompt tokens that every document of `schema` shares (instruction + schema):
        the common prefix with the prompt of an empty document."""
        key = schema_hash(schema)
        base = self._schema_prompts.get(key)
        if base is None:
            base = build_prompt(self.loaded.tokenizer, schema, "", self.loaded.context_len)
            self._schema_prompts[key] = base
            while len(self._schema_prompts) > 256:
                self._schema_prompts.popitem(last=False)
        self._schema_prompts.move_to_end(key)
        n = 0
        for a, b in zip(prompt, base):
            if a != b:
                break
            n += 1
        return min(n, len(prompt) - 1)

    def cancel(self, request_id: str) -> bool:
        """Stop a request at the next step boundary (its result: status "cancelled")."""
        seq = self.scheduler.find(request_id)
        if seq is None:
            return False
        seq.cancelled = True
        return True

    def clear_prefix_cache(self) -> None:
        """Forget every cached prefix (benchmarks that time each system's own prefill)."""
        self.kv.prefix.evict(self.kv.prefix.nbytes)

    def abort_all(self) -> None:
        """Drop every request without a result (after a crash of the engine itself)."""
        for seq in [*self.scheduler.running, *self.scheduler.waiting]:
            self.scheduler.retire(seq)

    def has_work(self) -> bool:
        return len(self.scheduler) > 0

    @property
    def running(self) -> int:
        return len(self.scheduler.running)

    @property
    def waiting(self) -> int:
        return len(self.scheduler.waiting)

    def run(self, requests: list[Request],
            on_result: Callable[[ExtractResult], None] | None = None) -> list[ExtractResult]:
        """Run `requests` together; results in the same order. A request refused at submission
        gets status "failed" with the reason. `on_result` is called with each result as it
        arrives (benchmarks time each document's latency by it)."""
        results: dict[str, ExtractResult] = {}

        def arrived(res: ExtractResult) -> None:
            results[res.request_id] = res
            if on_result is not None:
                on_result(res)

        for r in requests:
            try:
                self.submit(r)
            except ValueError as e:  # OptionError, SchemaError, DocumentTooLong, RequestTooLarge
                arrived(refused(r, e))
        while self.has_work():
            for res in self.step():
                arrived(res)
        return [results[r.id] for r in requests]

    def extract(self, schema: dict, document: str, options: RequestOptions | None = None,
                **request_fields) -> ExtractResult:
        """One document (raises what `submit` raises); `request_fields`: more Request fields
        (proposer, acceptance, trace, reuse_prompt)."""
        request = Request(schema, document, options or self.default_options(), **request_fields)
        self.submit(request)
        while True:
            for res in self.step():
                if res.request_id == request.id:
                    return res

    # --- one step ------------------------------------------------------------------------------

    def step(self) -> list[ExtractResult]:
        """Retire what was cancelled or is past its deadline (running or still waiting), admit,
        then one forward pass over every running sequence; the requests that finished."""
        sched = self.scheduler
        at = self.clock()
        done = [self._finish(s, "cancelled" if s.cancelled else "timeout") for s in [*sched.running, *sched.waiting]
                if s.cancelled or at >= s.request.deadline]
        now = time.perf_counter()
        for seq in sched.admit():
            seq.stats.queued_s = now - seq.submitted_at
        prefill, decoding = self._isolate_suspect(sched.prefill_work(), sched.decoding())
        if not prefill and not decoding:
            return done + [self._finish(s, None) for s in list(sched.running) if s.stop_reason]
        t0 = time.perf_counter()
        prefill_rows = sum(n for _, n in prefill)
        decoding = self._draft(decoding, len(decoding) + prefill_rows, done)
        decoding = self._mask(decoding, done)
        packed = pack(prefill, decoding, self.device)
        bitmask = self.bitmask[:packed.rows].to(self.device, non_blocking=True)
        if self.pruned_logits and decoding:
            packed.inputs.allowed = bitmask
        t1 = time.perf_counter()
        try:
            logits = self.runner.forward(packed.inputs)
            if self.sync_timing:  # the forward pass's own time, not its launch (the GPU kit's step breakdown)
                torch.cuda.synchronize(self.device)
            t2 = time.perf_counter()
            emitted = verify(logits, bitmask, packed, self.loaded.vocab_size, self.kernel_backend,
                             self.native_verify) if decoding else []
            probs = (emitted_probs(logits, bitmask, packed, emitted, self.native_verify)
                     if decoding and self.confidence else None)
        except Exception as e:  # the whole step failed: find the sequence that made it fail
            members = [*decoding, *(s for s, _ in prefill)]
            if len(members) == 1:
                done.append(self._fail(members[0], e))
                return done
            log.warning("engine step over %d sequences failed (%s: %s); stepping each alone to find the cause",
                        len(members), type(e).__name__, preview(e))
            for seq in decoding:  # as if this step never ran: grammar and KV back to before it
                seq.matcher.rollback(len(seq.draft))
            for seq in members:
                seq.slot.rollback(seq.slot.length - seq.cached)
                seq.suspect = True
            return done
        t3 = time.perf_counter()
        for seq in [*decoding, *(s for s, _ in prefill)]:
            seq.suspect = False  # it stepped without error (alone, if it was a suspect)
        for seq, n in prefill:
            sched.prefilled(seq, n)
        for b, seq in enumerate(decoding):
            traced = margins(logits, bitmask, packed.cu_list[b] + b, len(emitted[b])) if seq.margins is not None else None
            before, before_bytes = len(seq.out), len(seq.out_bytes)
            try:
                commit(seq, emitted[b], self.loaded.eos_token_ids, self.token_text.bytes_of, len(decoding))
                guard_loops(seq, self.token_text.bytes_of)
            except Exception as e:
                done.append(self._fail(seq, e))
                continue
            if traced is not None:
                gaps, tops = traced
                seq.margins += gaps[:len(seq.out) - before]
                seq.tops += tops[:len(seq.out) - before]
            if probs is not None:
                seq.probs += probs[b][:len(seq.out) - before]
            if seq.request.on_output is not None and len(seq.out_bytes) > before_bytes:
                self._emit(seq, bytes(seq.out_bytes[before_bytes:]))
        step_s = time.perf_counter() - t0
        self._account(packed, prefill, decoding, step_s, t2 - t1, t3 - t2)
        done += [self._finish(s, None) for s in list(sched.running) if s.stop_reason]
        return done

    @staticmethod
    def _emit(seq: Sequence, data: bytes) -> None:
        """Hand a pass's output bytes to the request's hook; one that raises is dropped."""
        try:
            seq.request.on_output(data)
        except Exception as e:
            log.warning("request %s: on_output raised %s: %s; no more output is handed to it", seq.id,
                        type(e).__name__, preview(e))
            seq.request.on_output = None

    @staticmethod
    def _isolate_suspect(prefill: list[tuple[Sequence, int]], decoding: list[Sequence]):
        """While sequences from a failed step are suspect, the step runs the first of them
        that has work alone: one that fails then is failed, the others resume batching after
        one clean step. (None with work: the others step without them.)"""
        suspect = next((s for s in [*decoding, *(s for s, _ in prefill)] if s.suspect), None)
        if suspect is None:
            return prefill, decoding
        return [(s, n) for s, n in prefill if s is suspect], [s for s in decoding if s is suspect]

    def _draft(self, decoding: list[Sequence], base_rows: int, done: list[ExtractResult]) -> list[Sequence]:
        """Every decoding sequence proposes up to its cap; the drafts of adaptive (`auto`)
        sequences are then trimmed to what pays in this batch (cost.py), so the plan is costed by
        the rows that really exist. A sequence whose proposer fails leaves the step (and the
        engine) with an error result; the others go on."""
        kept = []
        for seq in decoding:
            seq.k = seq.max_draft()
            try:
                propose(seq)
            except Exception as e:
                done.append(self._fail(seq, e))
                continue
            kept.append(seq)
        adaptive = [s for s in kept if s.request.acceptance is not None and s.draft]
        if adaptive:
            explore = self.metrics.decode_steps % EXPLORE_EVERY == EXPLORE_EVERY - 1
            ks = choose_draft_lens([len(s.draft) for s in adaptive], [s.request.acceptance for s in adaptive],
                                   base_rows + sum(len(s.draft) for s in kept if s not in adaptive), self.cost,
                                   base_tokens=len(kept), explore=explore, prefill_rows=base_rows - len(decoding),
                                   confidence=[s.ctx.confidence for s in adaptive])
            for seq, k in zip(adaptive, ks):
                if k < len(seq.draft):  # trimmed here: positions k.. were not offered to verification
                    seq.draft, seq.k = seq.draft[:k], k
        return kept

    def _mask(self, decoding: list[Sequence], done: list[ExtractResult]) -> list[Sequence]:
        """Bitmask rows of every draft, packed in one buffer (a grammar failure: as in _draft)."""
        kept, row = [], 0
        for seq in decoding:
            try:
                fill_bitmask(seq, self.bitmask, row)
            except Exception as e:
                done.append(self._fail(seq, e))
                continue
            kept.append(seq)
            row += len(seq.draft) + 1
        return kept

    def _account(self, packed, prefill, decoding, step_s: float, forward_s: float, verify_s: float) -> None:
        """Each request's prefill_s/decode_s: its share of the steps it took part in. In a step
        that also prefills, the decode rows are charged what the cost curve says a pass of
        them alone costs (at most the step), the prefill chunks the rest; within each part,
        by rows."""
        rows = packed.rows + packed.prefill_rows
        decode_part = 0.0
        if decoding:
            decode_part = step_s if not prefill else min(step_s, self.cost(packed.rows, len(decoding)))
        for seq, n in prefill:
            seq.stats.prefill_s += (step_s - decode_part) * n / packed.prefill_rows
        for seq in decoding:
            seq.stats.decode_s += decode_part * (len(seq.draft) + 1) / packed.rows
        m = self.metrics
        m.steps += 1
        m.rows += rows
        m.prefill_rows += packed.prefill_rows
        m.step_s += step_s
        m.forward_s += forward_s
        m.verify_s += verify_s
        if prefill:
            m.prefill_step_s += step_s
        if decoding:
            m.decode_steps += 1
            if not prefill:
                self.cost.observe(packed.rows, step_s, len(decoding))

    # --- results -------------------------------------------------------------------------------

    def _fail(self, seq: Sequence, error: Exception) -> ExtractResult:
        # The message may quote the document: a preview of it, and the stack without it.
        log.error("request %s failed: %s: %s", seq.id, type(error).__name__, preview(error),
                  extra={"stack": "".join(traceback.format_tb(error.__traceback__))[-1900:]})
        self.scheduler.retire(seq)
        seq.stats.finish("error", time.perf_counter() - seq.submitted_at)
        setting = limit_setting(str(error)) if isinstance(error, GrammarDeadEnd) else None
        reason = (f"grammar limit reached ({setting}; raise it for this schema): {error}" if setting
                  else f"internal error: {type(error).__name__}: {error}")
        return ExtractResult("error", None, self.token_text.text_of(seq.out), list(seq.out), seq.stats,
                             reason[:2000], seq.id, seq.margins, tops=seq.tops)

    def _finish(self, seq: Sequence, reason: str | None) -> ExtractResult:
        """Retire `seq` (reason overrides its stop reason: "cancelled", "timeout") and build its result."""
        self.scheduler.retire(seq)
        stop = reason or seq.stop_reason
        seq.stats.output_tokens = len(seq.out)
        seq.stats.finish(stop, time.perf_counter() - seq.submitted_at)
        text = self.token_text.text_of(seq.out)
        base = dict(text=text, tokens=list(seq.out), stats=seq.stats, request_id=seq.id, margins=seq.margins,
                    tops=seq.tops)
        if stop == "cancelled":
            return ExtractResult("cancelled", None, error="cancelled", **base)
        if stop == "timeout":
            return ExtractResult("timeout", None, error=timeout_error(seq.request.options.timeout_s), **base)
        if stop not in ("grammar", "eos"):
            why = {"max_tokens": "max_tokens reached", "context": "the model's context is full"}.get(stop)
            if stop == "repetition":
                g = seq.loop_guard
                where, shape = ("inside one string, ", " but for their digits") if g.rule == "counting" else ("", "")
                why = (f"the output repeats itself: {where}the last {g.period * g.repeats} tokens are one block of "
                       f"{g.period} tokens {g.repeats} times{shape} (loop guard, STRUCTSPEC_ENGINE_LOOP_REPEATS)")
            return ExtractResult("truncated", None, error=f"output truncated after {len(seq.out)} tokens: {why}",
                                 **base)
        schema = seq.request.schema
        try:
            value = json.loads(text)
        except json.JSONDecodeError as e:  # a grammar backend bug; never a silent success
            return ExtractResult("invalid", None, error=f"output is not JSON: {e}", **base)
        problems = validate_instance(schema, value)
        if problems:
            detail = "; ".join(f"{p.path or '/'} [{p.keyword}]: {p.message}" for p in problems[:5])
            return ExtractResult("invalid", None, error=f"output violates the schema: {detail}", **base)
        if self.histories is not None and seq.request.history is not None:
            self.histories.learn(seq.request.history, list(seq.out), text)
        confidence = None
        if self.confidence:
            confidence = confidences(text, [self.token_text.bytes_of([t]) for t in seq.out], seq.probs)
        return ExtractResult("succeeded", value, **base, spans=find_spans(seq.request.document, value),
                             confidence=confidence)


def refused(request: Request, error: Exception) -> ExtractResult:
    """The result of a request that could not be submitted."""
    opts = request.options
    stats = RequestStats(strategy=opts.strategy, draft_len=opts.draft_len or 0)
    stats.finish("refused", 0.0)
    return ExtractResult("failed", None, "", [], stats, str(error), request.id)


__all__ += ["Phase", "refused"]
