"""One entry point for extraction: schema + document -> JSON guaranteed to match the schema."""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from structspec.config import Settings
from structspec.engine.decode import DecodeOptions, DecodeStats, Decoder
from structspec.engine.model import LoadedModel, load_model
from structspec.engine.prompt import build_prompt
from structspec.engine.proposers import STRATEGIES, make_proposer
from structspec.engine.tokens import token_text
from structspec.grammar import GrammarCache, GrammarLimits, make_backend, validate_instance
from structspec.grammar.verbatim import uses_verbatim



@dataclass
class ExtractOptions:
    strategy: str = "composite"  # none | schema | ngram | composite
    draft_len: int = 8
    temperature: float = 0.0
    seed: int | None = None
    max_tokens: int = 1024
    verbatim: bool = False  # plain string fields only copy spans of the document (grammar/verbatim.py)

    def check(self) -> None:
        """Raise ValueError naming the first bad option."""
        if self.strategy not in STRATEGIES:
            raise ValueError(f"strategy must be one of {', '.join(STRATEGIES)}, not {self.strategy!r}")
        if not 0 <= self.draft_len <= 64:
            raise ValueError(f"draft_len must be between 0 and 64, not {self.draft_len}")
        if not 0 <= self.temperature <= 10:
            raise ValueError(f"temperature must be between 0 and 10, not {self.temperature}")
        if not 1 <= self.max_tokens <= 65536:
            raise ValueError(f"max_tokens must be between 1 and 65536, not {self.max_tokens}")


@dataclass
class ExtractStats:
    strategy: str
    draft_len: int
    prompt_tokens: int
    output_tokens: int
    target_passes: int
    proposed: int
    accepted: int
    acceptance_rate: float
    tokens_per_pass: float
    prefill_s: float
    decode_s: float
    wall_s: float
    stop_reason: str
    verbatim: bool = False  # some string of the grammar was limited to document spans
    accepted_by_position: list[int] = field(default_factory=list)
    proposed_by_position: list[int] = field(default_factory=list)

    @classmethod
    def build(cls, opts: ExtractOptions, prompt_tokens: int, s: DecodeStats, stop: str,
              wall_s: float, verbatim: bool = False) -> "ExtractStats":
        return cls(strategy=opts.strategy, draft_len=opts.draft_len, prompt_tokens=prompt_tokens,
                   output_tokens=s.output_tokens, target_passes=s.target_passes, proposed=s.proposed,
                   accepted=s.accepted, acceptance_rate=round(s.acceptance_rate, 4),
                   tokens_per_pass=round(s.tokens_per_pass, 4), prefill_s=round(s.prefill_s, 4),
                   decode_s=round(s.decode_s, 4), wall_s=round(wall_s, 4), stop_reason=stop, verbatim=verbatim,
                   accepted_by_position=s.accepted_by_position,
                   proposed_by_position=s.proposed_by_position)

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass
class ExtractResult:
    status: str  # "succeeded" | "truncated" | "invalid"
    value: Any  # the parsed JSON when status is succeeded
    text: str  # the raw generated text
    tokens: list[int]
    stats: ExtractStats
    error: str | None = None


class Engine:
    """A loaded model plus grammar machinery. Build once per process; reuse per request."""

    def __init__(self, loaded: LoadedModel, grammar_backend: str = "llguidance",
                 kernel_backend: str = "auto", grammar_limits: GrammarLimits | None = None):
        self.loaded = loaded
        self.kernel_backend = kernel_backend
        self.grammars = GrammarCache(make_backend(grammar_backend, loaded.tokenizer, loaded.vocab_size,
                                                  grammar_limits))
        self.token_text = token_text(loaded.tokenizer, loaded.vocab_size)
        self.decoder = Decoder(loaded.model, loaded.vocab_size, loaded.eos_token_ids, self.token_text,
                               loaded.context_len)

    @classmethod
    def from_settings(cls, settings: Settings) -> "Engine":
        loaded = load_model(settings.model, device=settings.device, dtype=settings.dtype,
                            cache_dir=settings.cache_dir)
        return cls(loaded, settings.grammar_backend, settings.kernel_backend,
                   GrammarLimits.from_settings(settings))

    def compile(self, schema: dict):
        """Check and compile `schema` (cached); raises SchemaError naming keyword and path."""
        return self.grammars.get(schema)

    def extract(self, schema: dict, document: str, opts: ExtractOptions | None = None,
                proposer=None) -> ExtractResult:
        """Generate JSON for `document` under `schema`.

        `proposer` overrides the strategy's proposer (tests inject adversarial ones).
        Raises SchemaError for an unusable schema and DocumentTooLong when the prompt does
        not fit the context; every other outcome is an ExtractResult.
        """
        opts = opts or ExtractOptions()
        opts.check()
        t0 = time.perf_counter()
        grammar = self.grammars.get_for(schema, document, opts.verbatim)
        prompt = build_prompt(self.loaded.tokenizer, schema, document, self.loaded.context_len)
        proposer = proposer or make_proposer(opts.strategy)
        verbatim = uses_verbatim(schema, opts.verbatim)
        out = self.decoder.run(prompt, grammar.matcher(), proposer, document,
                               DecodeOptions(draft_len=opts.draft_len, temperature=opts.temperature,
                                             seed=opts.seed, max_tokens=opts.max_tokens,
                                             kernel_backend=self.kernel_backend, verbatim=verbatim))
        text = self.token_text.text_of(out.tokens)
        stats = ExtractStats.build(opts, len(prompt), out.stats, out.stop_reason, time.perf_counter() - t0,
                                   verbatim=verbatim)
        if not out.finished:
            why = ("max_tokens reached" if out.stop_reason == "max_tokens"
                   else "the model's context is full")
            return ExtractResult("truncated", None, text, out.tokens, stats,
                                 f"output truncated after {len(out.tokens)} tokens: {why}")
        try:
            value = json.loads(text)
        except json.JSONDecodeError as e:  # a grammar backend bug; never a silent success
            return ExtractResult("invalid", None, text, out.tokens, stats, f"output is not JSON: {e}")
        problems = validate_instance(schema, value)
        if problems:
            detail = "; ".join(f"{p.path or '/'} [{p.keyword}]: {p.message}" for p in problems[:5])
            return ExtractResult("invalid", None, text, out.tokens, stats,
                                 f"output violates the schema: {detail}")
        return ExtractResult("succeeded", value, text, out.tokens, stats)
