"""JSON Schema -> token matcher, behind one backend protocol (see base.py)."""

from __future__ import annotations

import hashlib
import json
import threading
from collections import OrderedDict
from typing import Literal

from structspec.grammar.base import (DEFAULT_WHITESPACE, WHITESPACE_MODES, CompiledGrammar, GrammarBackend, Matcher,
                                     SchemaError, SchemaProblem)
from structspec.grammar.limits import GrammarLimits, SchemaLimitExceeded
from structspec.grammar.normalize import close_objects
from structspec.grammar.validation import check_meta_schema, validate_instance

BackendName = Literal["llguidance", "outlines"]
BACKENDS: tuple[str, ...] = ("llguidance", "outlines")

__all__ = ["DEFAULT_WHITESPACE", "WHITESPACE_MODES", "BackendName", "CompiledGrammar", "GrammarBackend", "GrammarCache", "GrammarLimits", "Matcher",
           "SchemaError", "SchemaLimitExceeded", "SchemaProblem", "check_schema", "make_backend", "schema_hash", "validate_instance"]


def schema_hash(schema: dict) -> str:
    """Content hash of a schema, independent of key order and whitespace."""
    canonical = json.dumps(schema, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(canonical.encode()).hexdigest()


def check_schema(schema: dict, limits: GrammarLimits | None = None) -> list[SchemaProblem]:
    """Everything compile() checks, without a tokenizer or model (~1 ms): the API uses it
    at registration. Raises SchemaError naming keyword and JSON path (SchemaLimitExceeded,
    naming the setting, for a grammar over `limits`); returns warnings for what the grammar
    does not enforce exactly (results are validated with jsonschema anyway)."""
    from structspec.grammar.llguidance_backend import prepare
    from structspec.grammar.verbatim import check_annotations

    check_meta_schema(schema)
    check_annotations(schema)
    return prepare(close_objects(schema), limits=limits).warnings


def make_backend(name: str, hf_tokenizer, vocab_size: int | None = None,
                 limits: GrammarLimits | None = None, whitespace: str = DEFAULT_WHITESPACE) -> GrammarBackend:
    """A backend compiling schemas for `hf_tokenizer`; `whitespace` is the JSON layout its
    grammars allow (base.py: WHITESPACE_MODES)."""
    if name == "llguidance":
        from structspec.grammar.llguidance_backend import LLGuidanceBackend
        return LLGuidanceBackend(hf_tokenizer, vocab_size, limits, whitespace)
    if name == "outlines":
        from structspec.grammar.outlines_backend import OutlinesBackend
        return OutlinesBackend(hf_tokenizer, vocab_size, whitespace)
    raise ValueError(f"unknown grammar backend {name!r}; choose one of {', '.join(BACKENDS)}")


class GrammarCache:
    """Compiled grammars keyed by schema hash, for one backend (so one tokenizer).

    Validates the schema against its meta-schema, then compiles the normalised schema
    (see normalize.close_objects), so every caller gets the same errors and grammar.
    """

    def __init__(self, backend: GrammarBackend, max_entries: int = 256):
        self.backend = backend
        self._max = max_entries
        self._items: OrderedDict[str, CompiledGrammar] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, schema: dict) -> CompiledGrammar:
        def build() -> CompiledGrammar:
            check_meta_schema(schema)
            return self.backend.compile(close_objects(schema))

        return self._cached(schema_hash(schema), build)

    def get_for(self, schema: dict, document: str, verbatim: bool) -> CompiledGrammar:
        """The grammar a request runs under: the schema's own, or, when some string of it is
        verbatim (the request's `verbatim` default or the schema's annotations), one compiled
        for this document (a few ms; cached too, since benchmarks reuse a document)."""
        from structspec.grammar.verbatim import check_annotations, uses_verbatim

        if not uses_verbatim(schema, verbatim):
            return self.get(schema)

        def build() -> CompiledGrammar:
            check_meta_schema(schema)
            check_annotations(schema)
            grammar = self.backend.compile_verbatim(close_objects(schema), document, verbatim)
            grammar.verbatim = True
            return grammar

        return self._cached(f"{schema_hash(schema)}:{verbatim}:{hashlib.sha256(document.encode()).hexdigest()}",
                            build)

    def _cached(self, key: str, build) -> CompiledGrammar:
        with self._lock:
            if key in self._items:
                self._items.move_to_end(key)
                return self._items[key]
        compiled = build()  # outside the lock: compiling takes milliseconds
        with self._lock:
            self._items[key] = compiled
            while len(self._items) > self._max:
                self._items.popitem(last=False)
        return compiled
