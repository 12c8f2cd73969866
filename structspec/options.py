"""Request options: the one definition of what a caller may ask of one extraction.

Fields, defaults, bounds and help live here; the API's request body, the CLI's flags, the
worker and the engine all read them (no torch, no web framework: every layer may import it).
A check that fails raises OptionError naming the field, so callers point at it (the API's
422 path, the CLI's flag) without searching the message text.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping

AUTO = "auto"
# The engine's drafting strategies (structspec/engine/proposers implements one per name).
STRATEGIES: tuple[str, ...] = ("none", "schema", "ngram", "suffix", "composite")
JOB_STRATEGIES: tuple[str, ...] = (AUTO,) + STRATEGIES
CHUNKING: tuple[str, ...] = ("off", "auto")


@dataclass(frozen=True)
class OptionSpec:
    """What one option accepts, for checks and for documentation (OpenAPI, --help)."""

    name: str
    help: str
    minimum: float | None = None
    maximum: float | None = None
    choices: tuple[str, ...] | None = None


SPECS: dict[str, OptionSpec] = {s.name: s for s in (
    OptionSpec("strategy", "auto (chosen per document from the schema's statistics) | none | schema | ngram | "
                           "suffix | composite", choices=JOB_STRATEGIES),
    OptionSpec("draft_len", "tokens drafted per step; with auto it fixes the largest k and only the strategy "
                            "is chosen (default: auto chooses k; the server's draft_len for a fixed strategy)",
               minimum=0, maximum=64),
    OptionSpec("temperature", "0 = greedy; > 0 samples from the masked, temperature-scaled target",
               minimum=0, maximum=10),
    OptionSpec("seed", "seed of a sampled request (temperature > 0); unset draws one", minimum=0,
               maximum=2**63 - 1),  # torch's generator takes a signed 64-bit seed
    OptionSpec("max_tokens", "most output tokens; a result cut there is reported as truncated",
               minimum=1, maximum=65536),
    OptionSpec("verbatim", "plain string fields only copy spans of the document; the schema annotation "
                           "x-structspec-verbatim: true|false overrides it per subschema"),
    OptionSpec("chunking", "off: a document longer than the model's context fails, saying so | auto: it is "
                           "extracted in overlapping chunks, decoded together, their results merged by the schema "
                           "(the stats say how many chunks)", choices=CHUNKING),
    OptionSpec("timeout_s", "seconds the extraction may take, counted from when the engine takes it (waiting there "
                            "for a place in the batch counts); past it the engine stops it and it fails naming this "
                            "limit (default: the server's STRUCTSPEC_JOB_TIMEOUT_S)", minimum=1, maximum=86400),
)}
OPTION_NAMES: tuple[str, ...] = tuple(SPECS)


class OptionError(ValueError):
    """One option is out of its bounds or unknown; `option` names it."""

    def __init__(self, option: str, message: str):
        self.option = option
        super().__init__(message)


@dataclass(frozen=True)
class RequestOptions:
    """One extraction's options. `None` means "the server's default" until `with_defaults`."""

    strategy: str = AUTO
    draft_len: int | None = None
    temperature: float = 0.0
    seed: int | None = None
    max_tokens: int | None = None
    verbatim: bool = False
    chunking: str = "off"
    timeout_s: int | None = None

    @classmethod
    def from_dict(cls, values: Mapping[str, Any] | None) -> "RequestOptions":
        """From stored or submitted JSON; None values mean "default"; unknown keys are refused."""
        values = dict(values or {})
        unknown = sorted(set(values) - set(OPTION_NAMES))
        if unknown:
            raise OptionError(unknown[0], f"unknown option {unknown[0]!r}; options are {', '.join(OPTION_NAMES)}")
        return cls(**{k: v for k, v in values.items() if v is not None})

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def replace(self, **changes) -> "RequestOptions":
        return dataclasses.replace(self, **changes)

    def with_defaults(self, settings) -> "RequestOptions":
        """Unset values from `settings` (a structspec.config.Settings): max_tokens, timeout_s, and
        draft_len for a fixed strategy (under auto an unset draft_len means "the selector chooses k")."""
        draft_len = self.draft_len
        if draft_len is None and self.strategy != AUTO:
            draft_len = settings.draft_len
        return self.replace(draft_len=draft_len,
                            max_tokens=settings.max_tokens if self.max_tokens is None else self.max_tokens,
                            timeout_s=settings.job_timeout_s if self.timeout_s is None else self.timeout_s)

    def check(self, concrete: bool = False) -> "RequestOptions":
        """Raise OptionError naming the first bad option; returns self. `concrete`: what the
        engine runs, so no auto and no unset draft_len, max_tokens or timeout_s."""
        allowed = STRATEGIES if concrete else JOB_STRATEGIES
        if self.strategy not in allowed:
            raise OptionError("strategy", f"strategy must be one of {', '.join(allowed)}, not {self.strategy!r}")
        for name in ("draft_len", "temperature", "max_tokens", "timeout_s"):
            value = getattr(self, name)
            if value is None:
                if concrete:
                    raise OptionError(name, f"{name} must be set")
                continue
            _check_number(SPECS[name], value)
        if self.seed is not None:
            _check_number(SPECS["seed"], self.seed)
        if not isinstance(self.verbatim, bool):
            raise OptionError("verbatim", f"verbatim must be true or false, not {self.verbatim!r}")
        if self.chunking not in CHUNKING:
            raise OptionError("chunking", f"chunking must be one of {', '.join(CHUNKING)}, not {self.chunking!r}")
        return self


def timeout_error(limit_s: int) -> str:
    """Why an extraction stopped at its time limit: the engine's result and the worker's job say so."""
    return (f"the job ran longer than its limit of {limit_s} s (options.timeout_s; server default "
            "STRUCTSPEC_JOB_TIMEOUT_S)")


def _check_number(spec: OptionSpec, value) -> None:
    kind = float if spec.name == "temperature" else int
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and not isinstance(value, int)):
        raise OptionError(spec.name, f"{spec.name} must be {'a number' if kind is float else 'an integer'}, "
                                     f"not {value!r}")
    if not spec.minimum <= value <= spec.maximum:
        shown = (lambda x: int(x) if kind is int else x)
        raise OptionError(spec.name, f"{spec.name} must be between {shown(spec.minimum)} and {shown(spec.maximum)}, "
                                     f"not {value}")
