"""llguidance backend (compile and mask times: docs/conformance.md, `python -m bench.conformance`)."""

from __future__ import annotations

import json
import re
import threading
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

import llguidance
from llguidance import LLMatcher

if TYPE_CHECKING:
    import torch

from structspec.grammar.base import (DEFAULT_WHITESPACE, WHITESPACE_GAP, SchemaError, SchemaProblem,
                                     check_whitespace)
from structspec.grammar.limits import GrammarLimits, SchemaLimitExceeded, limit_setting
from structspec.grammar.regex import schema_patterns
from structspec.grammar.validation import find_keyword, pointer

# llguidance's JSON options for each whitespace mode (base.py: WHITESPACE_MODES).
JSON_OPTIONS = {
    "flexible": {"whitespace_flexible": True, "whitespace_pattern": WHITESPACE_GAP},
    "compact": {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"},
}

_UNIMPLEMENTED = re.compile(r'Unimplemented keys: \[(.*?)\]')
_UNKNOWN_FORMAT = re.compile(r"Unknown format: ?([^\n]*)")
_MAX_REWRITES = 32


class LLGuidanceMatcher:
    def __init__(self, inner: LLMatcher):
        self._m = inner

    def consume(self, tokens: Sequence[int]) -> bool:
        return self._m.consume_tokens(list(tokens))

    def validate(self, tokens: Sequence[int]) -> int:
        return self._m.validate_tokens(list(tokens)) if tokens else 0

    def rollback(self, num_tokens: int) -> None:
        if num_tokens and not self._m.rollback(num_tokens):
            raise RuntimeError(f"grammar rollback of {num_tokens} tokens failed: {self._m.get_error()}")

    def fill_bitmask(self, bitmask: "torch.Tensor", row: int) -> None:
        v = bitmask[row]
        self._m.unsafe_compute_mask_ptr(v.data_ptr(), v.numel() * v.element_size())

    def forced_bytes(self) -> bytes:
        return self._m.compute_ff_bytes()

    def is_stopped(self) -> bool:
        return self._m.is_stopped()

    def is_accepting(self) -> bool:
        return self._m.is_accepting()

    def error(self) -> str:
        return self._m.get_error()


class LLGuidanceGrammar:
    verbatim = False  # GrammarCache.get_for sets it on a grammar compiled for one document

    def __init__(self, tokenizer: llguidance.LLTokenizer, grammar: str, limits=None):
        self._tokenizer = tokenizer
        self._grammar = grammar
        self._limits = limits  # llguidance.LLParserLimits or None (llguidance's defaults)

    def matcher(self) -> LLGuidanceMatcher:
        return LLGuidanceMatcher(LLMatcher(self._tokenizer, self._grammar, log_level=0, limits=self._limits))


_TOKENIZERS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_TOKENIZERS_LOCK = threading.Lock()


def llguidance_tokenizer(hf_tokenizer, vocab_size: int):
    """llguidance's tokenizer for `hf_tokenizer` over `vocab_size` ids, built once per tokenizer
    object (~0.35 s for a 49k vocabulary; the grammar backend and engine/tokens.py both need it)."""
    import llguidance.hf  # imports transformers: kept off the API's schema-check path

    with _TOKENIZERS_LOCK:
        built = _TOKENIZERS.setdefault(hf_tokenizer, {})
        if vocab_size not in built:
            built[vocab_size] = llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=vocab_size)
        return built[vocab_size]


class LLGuidanceBackend:
    name = "llguidance"

    def __init__(self, hf_tokenizer, vocab_size: int | None = None, limits: GrammarLimits | None = None,
                 whitespace: str = DEFAULT_WHITESPACE):
        self.vocab_size = vocab_size or len(hf_tokenizer)
        self.tokenizer = llguidance_tokenizer(hf_tokenizer, self.vocab_size)
        self.limits = limits or GrammarLimits()
        self.whitespace = check_whitespace(whitespace)

    def compile(self, schema: dict) -> LLGuidanceGrammar:
        return LLGuidanceGrammar(self.tokenizer, prepare(schema, self.tokenizer, self.limits, self.whitespace).grammar,
                                 self.limits.llguidance())

    def compile_verbatim(self, schema: dict, document: str, default: bool) -> LLGuidanceGrammar:
        """`schema` with its verbatim strings limited to spans of `document` (verbatim.py)."""
        from structspec.grammar.verbatim import build_lark

        prepared = prepare(schema, self.tokenizer, self.limits, self.whitespace)  # the same format/oneOf handling
        lark = build_lark(prepared.schema, document, default, prepared.options)
        grammar = LLMatcher.grammar_from_lark(lark)
        limits = self.limits.llguidance()
        is_error, messages = LLMatcher.validate_grammar_with_warnings(grammar, self.tokenizer, limits=limits)
        if is_error:
            first = messages[0].strip().splitlines()[0]
            setting = limit_setting(first)
            if setting:
                raise SchemaLimitExceeded(setting, [SchemaProblem(
                    "", f"verbatim grammar: {first} (setting {setting})", "x-structspec-verbatim")])
            raise SchemaError([SchemaProblem("", f"verbatim grammar: {first}", "x-structspec-verbatim")])
        return LLGuidanceGrammar(self.tokenizer, grammar, limits)


@dataclass
class Prepared:
    grammar: str
    schema: dict  # what was compiled: unknown formats dropped
    options: dict  # llguidance JSON options used
    warnings: list[SchemaProblem]  # what the grammar does not enforce exactly


def prepare(schema: dict, tokenizer: llguidance.LLTokenizer | None = None,
            limits: GrammarLimits | None = None, whitespace: str = DEFAULT_WHITESPACE) -> Prepared:
    """The llguidance grammar for `schema`; raises SchemaError. Needs no tokenizer to check.
    A grammar over `limits` (default: llguidance's) raises SchemaLimitExceeded naming the setting.

    Two things the engine cannot enforce compile anyway, with a warning, because every result
    is validated with jsonschema afterwards (a violation fails the job naming the keyword):
      * a `format` llguidance does not know is dropped: JSON Schema treats unknown formats as
        annotations, and so does jsonschema's validation;
      * a `oneOf` whose branches llguidance cannot prove disjoint is enforced as `anyOf`.
    """
    options, warnings, current = dict(JSON_OPTIONS[check_whitespace(whitespace)]), [], schema
    parser_limits = (limits or GrammarLimits()).llguidance()
    for _ in range(_MAX_REWRITES):
        grammar = LLMatcher.grammar_from_json_schema(json.dumps(current), overrides=options)
        is_error, messages = LLMatcher.validate_grammar_with_warnings(grammar, tokenizer, limits=parser_limits)
        if not is_error:
            return Prepared(grammar, current, options, warnings)
        message = messages[0]
        setting = limit_setting(message)
        if setting:
            first = message.strip().splitlines()[0]
            raise SchemaLimitExceeded(setting, [SchemaProblem(
                "", f"the schema's grammar is over a grammar engine limit: {first} (setting {setting})", None)])
        unknown = _UNKNOWN_FORMAT.search(message)
        if unknown:
            fmt = unknown.group(1).strip()
            current, paths = drop_format(current, fmt)
            if not paths:
                break
            warnings += [SchemaProblem(p, f"format {fmt!r} is unknown to the grammar engine and not enforced "
                                          f"(an annotation, as in JSON Schema)", "format") for p in paths]
            continue
        if "coerce_one_of" in message and not options.get("coerce_one_of"):
            options["coerce_one_of"] = True
            warnings += [SchemaProblem(p, "oneOf is generated as anyOf; a value that matches several branches "
                                          "fails validation after generation", "oneOf")
                         for p in find_keyword(current, "oneOf")]
            continue
        raise SchemaError(_problems(schema, message))
    raise SchemaError(_problems(schema, message))


def drop_format(schema, fmt: str, path: tuple = ()) -> tuple[object, list[str]]:
    """Copy of `schema` without `"format": fmt` anywhere; the JSON pointers it was removed at."""
    if isinstance(schema, list):
        found: list[str] = []
        out = []
        for i, item in enumerate(schema):
            new, paths = drop_format(item, fmt, path + (i,))
            out.append(new)
            found += paths
        return out, found
    if not isinstance(schema, dict):
        return schema, []
    found, out = [], {}
    for k, v in schema.items():
        if k == "format" and v == fmt:
            found.append(pointer(path + (k,)))
            continue
        if k in ("enum", "const", "examples", "default"):
            out[k] = v
            continue
        out[k], paths = drop_format(v, fmt, path + (k,))
        found += paths
    return out, found


def _problems(schema: dict, message: str) -> list[SchemaProblem]:
    """Turn an llguidance compile error into problems that name keyword and path."""
    m = _UNIMPLEMENTED.search(message)
    if m:
        keywords = [k.strip().strip('"') for k in m.group(1).split(",") if k.strip()]
        out = []
        for kw in keywords:
            paths = list(find_keyword(schema, kw)) or [""]
            out += [SchemaProblem(p, f"keyword {kw!r} is not supported by the grammar engine", kw)
                    for p in paths]
        return out
    lines = [line.strip() for line in message.strip().splitlines() if line.strip()]
    # a pattern the grammar engine refuses: "regex parse error:", the pattern, carets, "error: <reason>";
    # or one line ending "... in regex /<pattern>/"
    parse_error = bool(lines) and lines[0].startswith("regex parse error") and len(lines) >= 2
    at = [(path, pattern) for path, pattern in schema_patterns(schema)
          if (parse_error and pattern.strip() == lines[1]) or f"regex /{pattern}/" in message]
    if not at and (parse_error or " in regex /" in message):  # the engine quotes its own rewrite: name them all
        at = list(schema_patterns(schema))
    if at:
        reason = (next((line[len("error:"):].strip() for line in lines if line.startswith("error:")), lines[-1])
                  if parse_error else lines[0].split("; ")[0])
        return [SchemaProblem(pointer(path), f"pattern {pattern!r} cannot be compiled by the grammar engine: {reason}",
                              "pattern") for path, pattern in at]
    return [SchemaProblem("", " ".join(lines[:3]) if lines else "the grammar engine refused the schema", None)]
