"""One request's state in the engine: what was asked, where it stands, what it cost."""

from __future__ import annotations

import enum
import time
import uuid
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Sequence as Seq

import torch

from structspec.engine.loopguard import LoopGuard
from structspec.engine.proposers import DraftContext, Proposer
from structspec.grammar import Matcher
from structspec.options import RequestOptions


@dataclass
class Request:
    """What a caller submits: a schema, a document and concrete options."""

    schema: dict
    document: str
    options: RequestOptions
    id: str = field(default_factory=lambda: uuid.uuid4().hex)
    proposer: Proposer | None = None  # overrides the strategy's proposer (tests inject adversarial ones)
    # Per-position acceptance of a drafted token of the chosen strategy for this schema (`auto`;
    # Selector.draft_acceptance): the engine then verifies fewer than options.draft_len tokens
    # where more do not pay in the batch at hand (engine/cost.py).
    # None: draft options.draft_len every step (a fixed strategy).
    acceptance: Seq[float] | None = None
    trace: bool = False  # record each output token's top-2 masked logit gap (exactness tests)
    # keep this prompt's KV for later requests with the same prompt (benchmarks running one
    # document under several strategies); otherwise only the schema's shared prefix is kept
    reuse_prompt: bool = False
    # the prompt: these chat messages ({role, content}) through the model's chat template
    # instead of the extraction prompt around `document` (the OpenAI-compatible surface);
    # `document` then holds their text, which the n-gram proposers draft from
    messages: list[dict[str, str]] | None = None
    # decode this request with no other sequence in the engine (a job retried after its worker
    # died: if the document is what crashes the process, it takes no neighbour with it)
    isolate: bool = False
    # called from the engine's thread with the output bytes each pass adds (streamed replies);
    # it must be quick and must not raise (an exception is logged and the hook dropped)
    on_output: Callable[[bytes], None] | None = None
    # when the request's time is up, on the engine's clock (Engine.clock): Engine.submit sets it to
    # its arrival plus options.timeout_s unless given; the chunks of one document carry their
    # document's (services/chunks.py), so the limit holds for the whole document
    deadline: float | None = None
    # whose earlier outputs this request drafts from and, once it succeeds, adds to (the suffix
    # proposer, engine/proposers/suffix.py): the worker names the tenant and schema version, so
    # that no tenant's outputs draft another's; None: it neither drafts from nor adds to any
    history: str | None = None
    # output texts (oldest first) to build that memory from if this engine holds none for it yet
    # (a worker that just started: the schema's latest succeeded jobs)
    history_seed: Seq[str] | None = None


@dataclass
class RequestStats:
    """Everything measured about one request; stored with the job and folded into the schema's
    per-arm statistics (structspec/stats)."""

    strategy: str
    draft_len: int
    verbatim: bool = False  # some string of the grammar was limited to document spans
    prompt_tokens: int = 0
    prefill_tokens: int = 0  # prompt tokens computed (the rest came from the prefix cache)
    prefix_tokens: int = 0  # prompt tokens whose KV was reused from the prefix cache
    output_tokens: int = 0
    target_passes: int = 0  # decode steps the request took part in
    proposed: int = 0  # draft tokens sent to verification (after the grammar cut)
    accepted: int = 0
    proposed_by_position: list[int] = field(default_factory=list)
    accepted_by_position: list[int] = field(default_factory=list)
    # passes in which draft position i was offered (the scheduler's k > i) and positions < i were
    # accepted: the trials of position i's conditional acceptance
    reached_by_position: list[int] = field(default_factory=list)
    batch_size: float = 0.0  # mean number of sequences decoded in the steps it took part in
    queued_s: float = 0.0  # submitted -> admitted
    # the request's share of the steps it took part in, by rows (prefill rows, decode rows)
    prefill_s: float = 0.0
    decode_s: float = 0.0
    wall_s: float = 0.0  # submitted -> finished
    stop_reason: str = ""
    _batch_sum: int = 0

    def record_step(self, offered: int, drafted: int, accepted: int, batch_size: int) -> None:
        self.target_passes += 1
        self.proposed += drafted
        self.accepted += accepted
        self._batch_sum += batch_size
        grow = offered - len(self.reached_by_position)
        if grow > 0:
            for name in ("proposed_by_position", "accepted_by_position", "reached_by_position"):
                getattr(self, name).extend([0] * grow)
        for i in range(offered):
            if i <= accepted:
                self.reached_by_position[i] += 1
            if i < drafted:
                self.proposed_by_position[i] += 1
            if i < accepted:
                self.accepted_by_position[i] += 1

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0

    @property
    def tokens_per_pass(self) -> float:
        return self.output_tokens / self.target_passes if self.target_passes else 0.0

    def finish(self, stop_reason: str, wall_s: float) -> None:
        self.stop_reason = stop_reason
        self.wall_s = wall_s
        self.batch_size = self._batch_sum / self.target_passes if self.target_passes else 0.0

    def as_dict(self) -> dict[str, Any]:
        out = {k: v for k, v in asdict(self).items() if not k.startswith("_")}
        for name in ("prefill_s", "decode_s", "wall_s", "queued_s", "batch_size"):
            out[name] = round(out[name], 4)
        out["acceptance_rate"] = round(self.acceptance_rate, 4)
        out["tokens_per_pass"] = round(self.tokens_per_pass, 4)
        return out


@dataclass
class ExtractResult:
    status: str  # "succeeded" | "truncated" | "invalid" | "cancelled" | "timeout" | "error" | "failed" (refused)
    value: Any  # the parsed JSON when status is succeeded
    text: str  # the raw generated text
    tokens: list[int]
    stats: RequestStats
    error: str | None = None
    request_id: str = ""
    margins: list[float] | None = None  # with Request.trace: top-2 masked logit gap per output token
    tops: list[float] | None = None  # with Request.trace: the top masked logit per output token
    # a succeeded result's grounding (engine/grounding.py), keyed by JSON Pointer: each string's
    # [start, end) in the document or None; each leaf's {min, mean} token probability
    spans: dict[str, list[int] | None] | None = None
    confidence: dict[str, dict[str, float]] | None = None


class Phase(enum.Enum):
    WAITING = "waiting"  # not admitted: no KV slot yet
    PREFILL = "prefill"  # admitted, prompt KV being computed in chunks
    DECODE = "decode"
    DONE = "done"


class Sequence:
    """A request inside the engine: tokens, grammar state, drafting context, KV slot, stats."""

    def __init__(self, request: Request, prompt: list[int], prefix_len: int, matcher: Matcher,
                 proposer: Proposer, ctx: DraftContext, generator: torch.Generator | None, verbatim: bool,
                 loop_repeats: int = 0, loop_counting: bool = True):
        opts = request.options
        self.request = request
        self.prompt = prompt
        self.prefix_len = prefix_len  # leading prompt tokens every document of this schema shares
        self.matcher = matcher
        self.proposer = proposer
        self.ctx = ctx
        self.generator = generator
        self.max_tokens: int = opts.max_tokens  # type: ignore[assignment]
        # `none` drafts nothing, so it offers no positions (an injected proposer still drafts)
        plain = opts.strategy == "none" and request.proposer is None
        self.draft_len: int = 0 if plain else opts.draft_len  # type: ignore[assignment]
        self.temperature = opts.temperature
        self.phase = Phase.WAITING
        self.slot = None
        self.cached = 0  # prompt/output tokens whose KV is in the slot
        self.last = prompt[-1]  # the token the next decode step feeds
        self.out: list[int] = []
        ctx.output_tokens = self.out  # the suffix proposer matches the output's token tail
        self.out_bytes = bytearray()
        self.margins: list[float] | None = [] if request.trace else None
        self.tops: list[float] | None = [] if request.trace else None
        self.probs: list[float] = []  # masked probability of each output token (grounding.py)
        self.loop_guard = LoopGuard(loop_repeats, loop_counting) if loop_repeats else None  # engine/loopguard.py
        self.stop_reason: str | None = None
        self.cancelled = False
        # in a step that raised beside other sequences: it steps alone until one step succeeds
        # (Engine.step), so a poisoned document is found and failed, and only it
        self.suspect = False
        self.stats = RequestStats(strategy=opts.strategy, draft_len=self.draft_len, verbatim=verbatim,
                                  prompt_tokens=len(prompt))
        self.submitted_at = time.perf_counter()
        # this step's plan
        self.k = 0  # draft positions offered to verification (a draft cut short by the proposer or
        # the grammar still offered them: they count as rejected; one the scheduler trimmed did not)
        self.draft: list[int] = []

    @property
    def id(self) -> str:
        return self.request.id

    @property
    def prefill_target(self) -> int:
        """Prompt tokens whose KV precedes the first decode step (all but the last)."""
        return len(self.prompt) - 1

    @property
    def budget(self) -> int:
        return self.max_tokens - len(self.out)

    def capacity(self, context_len: int) -> int:
        """KV positions this request can ever need: drafts never run past max_tokens."""
        return min(context_len, len(self.prompt) + self.max_tokens)

    def max_draft(self) -> int:
        """The most draft tokens this step may offer: k <= draft_len, never past max_tokens or
        the slot's capacity ([last, draft...] is written at cached..cached + k)."""
        return max(0, min(self.draft_len, self.budget - 1, self.slot.capacity - self.cached - 1))
