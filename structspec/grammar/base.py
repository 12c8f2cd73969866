"""The grammar backend protocol: JSON Schema -> a token-level matcher.

Every backend (llguidance, outlines) implements the same small surface, shaped after
what speculative verification needs: validate a draft and cut it at the first invalid
token, fill one bitmask row per draft position, roll back rejected tokens, and report
the bytes the grammar forces next (the schema proposer drafts from those).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, Sequence

if TYPE_CHECKING:
    import torch


# How a result's JSON may be laid out between its tokens (Settings.json_whitespace).
#   flexible: any JSON whitespace, as plain constrained decoding allows it (vLLM's structured
#     outputs, llguidance's and outlines' own defaults): the model writes its habitual layout,
#     newlines and indentation, which small models extract markedly better in
#     (docs/benchmarks.md). Each gap is capped at WHITESPACE_CAP characters so a model cannot
#     spend its tokens on blank space.
#   compact: none at all; the structure is forced byte for byte, so the schema proposer can
#     draft all of it (faster, and the model's habit is overridden).
WHITESPACE_MODES: tuple[str, ...] = ("flexible", "compact")
DEFAULT_WHITESPACE = "flexible"
WHITESPACE_CAP = 64
WHITESPACE_GAP = "[ \\t\\n\\r]{0,%d}" % WHITESPACE_CAP  # the regex of one gap in flexible mode


def check_whitespace(mode: str) -> str:
    if mode not in WHITESPACE_MODES:
        raise ValueError(f"unknown JSON whitespace mode {mode!r}; choose one of {', '.join(WHITESPACE_MODES)}")
    return mode


@dataclass(frozen=True)
class SchemaProblem:
    """One reason a schema cannot be used, located by JSON pointer."""

    path: str  # JSON pointer into the schema, "" for the root
    message: str
    keyword: str | None = None

    def as_dict(self) -> dict:
        return {"path": self.path, "keyword": self.keyword, "message": self.message}


class SchemaError(ValueError):
    """The schema is invalid JSON Schema, or uses something the backend cannot enforce."""

    def __init__(self, problems: Sequence[SchemaProblem]):
        self.problems = list(problems)
        super().__init__("; ".join(_describe(p) for p in self.problems))


def _describe(p: SchemaProblem) -> str:
    where = p.path or "/"
    kw = f" [{p.keyword}]" if p.keyword else ""
    return f"{where}{kw}: {p.message}"


class Matcher(Protocol):
    """Grammar state for one generation. Not thread-safe; one per request."""

    def consume(self, tokens: Sequence[int]) -> bool:
        """Advance over all `tokens`; False (and an error state) if any is invalid."""

    def validate(self, tokens: Sequence[int]) -> int:
        """How many leading `tokens` the grammar accepts from here; state unchanged."""

    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` consumed tokens."""

    def fill_bitmask(self, bitmask: "torch.Tensor", row: int) -> None:
        """Write the allowed-next-token bits into `bitmask[row]` (int32, packed)."""

    def forced_bytes(self) -> bytes:
        """Bytes every valid continuation starts with (may be empty)."""

    def is_stopped(self) -> bool:
        """True when the grammar is complete and admits nothing but EOS."""

    def is_accepting(self) -> bool:
        """True when the output so far is a complete value (EOS would be valid)."""

    def error(self) -> str:
        """The matcher's error message, "" when healthy."""


class CompiledGrammar(Protocol):
    """An immutable compiled schema; cheap to start matchers from. `verbatim`: some string of it
    is limited to spans of a document (set by GrammarCache.get_for; the engine's proposers read
    it)."""

    verbatim: bool

    def matcher(self) -> Matcher: ...


class GrammarBackend(Protocol):
    """Compiles schemas for one tokenizer."""

    name: str
    vocab_size: int

    def compile(self, schema: dict) -> CompiledGrammar:
        """Compile `schema`; raise SchemaError naming the keyword and path on failure."""

    def compile_verbatim(self, schema: dict, document: str, default: bool) -> CompiledGrammar:
        """Compile `schema` with its verbatim strings limited to spans of `document`
        (grammar/verbatim.py); `default` is the request's verbatim option."""

