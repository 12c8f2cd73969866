"""outlines backend: JSON Schema -> regex -> token-level DFA index (outlines_core).

The Vocabulary is built once per backend and the Index once per schema. The Index is a
DFA over the vocabulary, so its build grows steeply with bounded string lengths and with
unconstrained values (`{"type": "object"}`); matcher steps are lookups in it, and a
state's mask is built once and then cached. Its costs: docs/conformance.md (outlines section).

outlines' schema translation is loose: it silently ignores many keywords and a few
of its regexes can produce text that is not valid JSON. `compile` therefore checks
the schema first and raises SchemaError, naming keyword and path, for everything
the generated regex would not enforce (see `unsupported_problems`).
"""

from __future__ import annotations

import ctypes
import json
import operator
import re
import threading
from typing import Any, Iterable, Sequence

import numpy as np
import torch
from outlines_core import Index, Vocabulary
from outlines_core import json_schema as oc_json_schema

from structspec.grammar.base import DEFAULT_WHITESPACE, WHITESPACE_GAP, SchemaError, SchemaProblem, check_whitespace
from structspec.grammar.validation import find_keyword, pointer

# The regex of one whitespace gap in each mode (base.py: WHITESPACE_MODES), as llguidance's.
WHITESPACE_PATTERN = {"flexible": WHITESPACE_GAP, "compact": ""}

# Index build time grows roughly x1.7 per unit of a string's minLength/maxLength
# (0.12 s at 10, 5 s at 16, minutes beyond 20); refuse bounds above this.
MAX_STRING_LENGTH_BOUND = 12

# Masks cached per DFA state (one int32 row each, ~6 KB for a 49k vocab).
MAX_CACHED_MASKS = 1024

_STOP = -1  # matcher state after EOS was consumed


# ----------------------------------------------------------------------------- vocabulary

def _gpt2_byte_decoder() -> dict[str, int]:
    """Inverse of GPT-2's bytes_to_unicode: printable stand-in char -> raw byte."""
    bs = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
          + list(range(ord("®"), ord("ÿ") + 1)))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


_BYTE_DECODER = _gpt2_byte_decoder()
_BYTE_FALLBACK = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


def _decoder_kind(hf_tokenizer) -> str:
    """'byte_level' (GPT-2 style) or 'sentencepiece' (▁ for space, <0xNN> byte fallback)."""
    backend = getattr(hf_tokenizer, "backend_tokenizer", None)
    if backend is not None:
        try:
            decoder = json.loads(backend.to_str()).get("decoder")
        except Exception:  # pragma: no cover - exotic tokenizers
            decoder = None
        if decoder is not None and "ByteLevel" in json.dumps(decoder):
            return "byte_level"
    return "sentencepiece"


def token_bytes_table(hf_tokenizer, vocab_size: int) -> tuple[list[bytes | None], int]:
    """The raw bytes of every token id below `vocab_size` (None: never allowed), and EOS.

    Special tokens (<|im_start|>, ...) and ids the tokenizer does not define map to
    None; EOS too, since outlines handles it apart from the vocabulary.
    """
    eos = hf_tokenizer.eos_token_id
    if eos is None:
        raise ValueError("the tokenizer has no eos_token_id; the outlines backend needs one")
    table: list[bytes | None] = [None] * vocab_size
    added = getattr(hf_tokenizer, "added_tokens_decoder", {}) or {}
    special = {i for i, tok in added.items() if getattr(tok, "special", False)}
    special |= set(getattr(hf_tokenizer, "all_special_ids", []) or [])
    kind = _decoder_kind(hf_tokenizer)
    for token, i in hf_tokenizer.get_vocab().items():
        if i >= vocab_size or i < 0 or i in special or i == eos:
            continue
        if i in added:  # non-special added tokens are stored as plain text
            raw = added[i].content.encode("utf-8")
        elif kind == "byte_level":
            try:
                raw = bytes(_BYTE_DECODER[c] for c in token)
            except KeyError:
                raw = hf_tokenizer.convert_tokens_to_string([token]).encode("utf-8")
        else:
            m = _BYTE_FALLBACK.match(token)
            raw = bytes([int(m.group(1), 16)]) if m else token.replace("▁", " ").encode("utf-8")
        if raw:
            table[i] = raw
    return table, eos


def build_vocabulary(table: Sequence[bytes | None], eos: int) -> Vocabulary:
    """outlines Vocabulary from raw token bytes, without the hub.

    `Vocabulary(eos_token_id, map)` takes `dict[str | bytes, list[int]]`; str keys are
    used as their UTF-8 encoding as is, so byte-level tokens ('Ġhello') must be
    decoded to bytes first, which is why keys here are bytes. EOS must not be in map.

    Besides the real tokens (ids < len(table)) it holds 256 probe tokens, id
    len(table) + b for the single byte b, never allowed to the model: they give the
    index byte-level transitions, which forced_bytes walks, at no extra DFA build.
    """
    mapping: dict[bytes, list[int]] = {}
    for i, raw in enumerate(table):
        if raw is not None:
            mapping.setdefault(raw, []).append(i)
    for b in range(256):
        mapping.setdefault(bytes([b]), []).append(len(table) + b)
    return Vocabulary(eos, mapping)


# ----------------------------------------------------------------------------- matcher

class OutlinesMatcher:
    """One generation's position in the index: a stack of DFA states, one per token."""

    def __init__(self, grammar: "OutlinesGrammar"):
        self._g = grammar
        self._states: list[int] = [grammar.initial_state]
        self._error = ""

    # -- transitions
    def _next(self, state: int, token: int) -> int | None:
        g = self._g
        if state == _STOP:
            return None
        try:
            token = operator.index(token)
        except TypeError:
            return None
        if token == g.eos_token_id:
            return _STOP if g.index.is_final_state(state) else None
        if not 0 <= token < g.vocab_size:
            return None
        return g.index.get_next_state(state, token)

    def consume(self, tokens: Sequence[int]) -> bool:
        if self._error:
            return False
        for tok in tokens:
            nxt = self._next(self._states[-1], tok)
            if nxt is None:
                self._error = (f"token {tok} is not allowed here (after {len(self._states) - 1} "
                               f"tokens)" if self._states[-1] != _STOP
                               else f"token {tok} after EOS")
                return False
            self._states.append(nxt)
        return True

    def validate(self, tokens: Sequence[int]) -> int:
        if self._error:
            return 0
        state = self._states[-1]
        for n, tok in enumerate(tokens):
            state = self._next(state, tok)
            if state is None:
                return n
        return len(tokens)

    def rollback(self, num_tokens: int) -> None:
        """Undo consumed tokens. A refused token was never consumed, so this also clears
        the error state (llguidance refuses to roll back once in error)."""
        if num_tokens < 0 or num_tokens > len(self._states) - 1:
            raise RuntimeError(f"grammar rollback of {num_tokens} tokens failed: only "
                               f"{len(self._states) - 1} consumed")
        if num_tokens:
            del self._states[-num_tokens:]
        self._error = ""

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        state = self._states[-1]
        g = self._g
        mask, ptr = g.eos_only_mask if (self._error or state == _STOP) else g.mask(state)
        words = mask.shape[0]
        if (bitmask.device.type == "cpu" and bitmask.dtype == torch.int32 and bitmask.dim() == 2
                and bitmask.stride(1) == 1 and bitmask.shape[1] >= words
                and 0 <= row < bitmask.shape[0]):
            # plain memcpy: ~1 µs, where torch indexing + copy_ costs several
            dst = bitmask.data_ptr() + row * bitmask.stride(0) * 4
            ctypes.memmove(dst, ptr, words * 4)
            if bitmask.shape[1] > words:
                ctypes.memset(dst + words * 4, 0, (bitmask.shape[1] - words) * 4)
            return
        out = bitmask[row]
        n = min(out.numel(), words)
        if n < out.numel():
            out[n:].zero_()
        out[:n].copy_(torch.tensor(mask[:n]))

    def forced_bytes(self) -> bytes:
        state = self._states[-1]
        if self._error or state == _STOP:
            return b""
        return self._g.forced_bytes(state)

    def is_stopped(self) -> bool:
        state = self._states[-1]
        return bool(self._error) or state == _STOP or self._g.only_eos(state)

    def is_accepting(self) -> bool:
        state = self._states[-1]
        return not self._error and (state == _STOP or self._g.index.is_final_state(state))

    def error(self) -> str:
        return self._error

    # -- introspection, for tests and debugging
    @property
    def state(self) -> int:
        return self._states[-1]

    def num_consumed(self) -> int:
        return len(self._states) - 1


# ----------------------------------------------------------------------------- compiled

class OutlinesGrammar:
    """A compiled index plus lazily built, shared per-state data (masks, forced bytes)."""

    verbatim = False  # GrammarCache.get_for sets it on a grammar compiled for one document

    def __init__(self, backend: "OutlinesBackend", regex: str, index: Index):
        self.regex = regex
        self.index = index
        self.initial_state: int = index.get_initial_state()
        self.vocab_size = backend.vocab_size
        self.eos_token_id = backend.eos_token_id
        self._probe_base = backend.probe_base  # token id of the probe for byte 0
        self._n_words = (self.vocab_size + 31) // 32
        self._masks: dict[int, tuple[np.ndarray, int]] = {}  # state -> (words, address)
        self._forced: dict[int, bytes] = {}
        self._only_eos: dict[int, bool] = {}
        self._lock = threading.Lock()
        eos_only = self._pack([self.eos_token_id])
        eos_only.flags.writeable = False
        self.eos_only_mask = (eos_only, eos_only.ctypes.data)

    def matcher(self) -> OutlinesMatcher:
        return OutlinesMatcher(self)

    @property
    def num_states(self) -> int:
        return len(self.index.get_transitions())

    # -- masks
    def _pack(self, token_ids: Iterable[int]) -> np.ndarray:
        ids = np.fromiter(token_ids, dtype=np.int64)
        ids = ids[(ids >= 0) & (ids < self.vocab_size)]  # drops the byte probes
        bits = np.zeros(self._n_words * 32, dtype=np.bool_)
        bits[ids] = True
        # little bit order + little-endian int32: bit t % 32 of word t // 32 is token t.
        return np.ascontiguousarray(np.packbits(bits, bitorder="little").view("<i4"), dtype=np.int32)

    def allowed_tokens(self, state: int) -> list[int]:
        """Token ids the model may produce in `state` (EOS included when final)."""
        allowed = [t for t in self.index.get_allowed_tokens(state) if t < self.vocab_size]
        if self.index.is_final_state(state) and self.eos_token_id not in allowed:
            allowed.append(self.eos_token_id)
        return allowed

    def mask(self, state: int) -> tuple[np.ndarray, int]:
        """The packed allowed-token mask of `state` and its address (cached; read-only)."""
        m = self._masks.get(state)
        if m is None:
            words = self._pack(self.index.get_allowed_tokens(state))
            if self.index.is_final_state(state):
                words.view(np.uint32)[self.eos_token_id // 32] |= np.uint32(1 << (self.eos_token_id % 32))
            words.flags.writeable = False
            m = (words, words.ctypes.data)
            with self._lock:
                while len(self._masks) >= MAX_CACHED_MASKS:
                    self._masks.pop(next(iter(self._masks)))
                self._masks[state] = m
        return m

    def only_eos(self, state: int) -> bool:
        r = self._only_eos.get(state)
        if r is None:
            r = (self.index.is_final_state(state)
                 and all(t == self.eos_token_id or t >= self.vocab_size
                         for t in self.index.get_allowed_tokens(state)))
            self._only_eos[state] = r
        return r

    # -- forced bytes
    def _single_next_byte(self, state: int) -> tuple[int, int] | None:
        """(byte, next state) if exactly one byte can follow `state` in the DFA, else None.

        Probes the 256 byte tokens (stops at the second hit, so busy states such as
        string contents cost a few dozen lookups). Final states force nothing: stopping
        is a valid continuation.
        """
        if self.index.is_final_state(state):
            return None
        found = None
        nxt_state = self.index.get_next_state
        base = self._probe_base
        for b in range(256):
            nxt = nxt_state(state, base + b)
            if nxt is not None:
                if found is not None:
                    return None
                found = (b, nxt)
        return found

    def forced_bytes(self, state: int) -> bytes:
        """Bytes every continuation from `state` starts with: follow the DFA while exactly
        one byte can come next and stopping is not allowed.

        Exact at the byte level, so conservative at the token level (a byte no token
        sequence could produce still counts as possible). Cached per state.
        """
        cached = self._forced.get(state)
        if cached is not None:
            return cached
        out = bytearray()
        s, seen = state, {state}
        while True:
            step = self._single_next_byte(s)
            if step is None:
                break
            b, s = step
            out.append(b)
            if s in seen:  # impossible in a trimmed DFA; never loop forever
                break
            seen.add(s)
        result = bytes(out)
        self._forced[state] = result
        return result


# ----------------------------------------------------------------------------- backend

class OutlinesBackend:
    name = "outlines"

    def __init__(self, hf_tokenizer, vocab_size: int | None = None, whitespace: str = DEFAULT_WHITESPACE):
        self.whitespace = check_whitespace(whitespace)
        self.vocab_size = vocab_size or len(hf_tokenizer)
        self.token_bytes, self.eos_token_id = token_bytes_table(hf_tokenizer, self.vocab_size)
        if not 0 <= self.eos_token_id < self.vocab_size:
            raise ValueError(f"eos_token_id {self.eos_token_id} outside vocab_size {self.vocab_size}")
        # ~0.3 s for a 49k vocab: built once per backend.
        self.vocabulary = build_vocabulary(self.token_bytes, self.eos_token_id)
        self.probe_base = self.vocab_size  # byte probe tokens: vocab_size + b

    def compile_verbatim(self, schema: dict, document: str, default: bool) -> OutlinesGrammar:
        raise SchemaError([SchemaProblem("", "verbatim extraction needs the llguidance grammar backend "
                                             "(outlines has no substring constraint)", "x-structspec-verbatim")])

    def compile(self, schema: dict) -> OutlinesGrammar:
        problems = unsupported_problems(schema)
        if problems:
            raise SchemaError(problems)
        try:
            regex = oc_json_schema.build_regex_from_schema(json.dumps(schema), WHITESPACE_PATTERN[self.whitespace])
        except (ValueError, TypeError) as e:
            raise SchemaError(_problems_from_message(schema, str(e))) from None
        try:
            index = Index(regex, self.vocabulary)
        except (ValueError, TypeError) as e:
            first = str(e).strip().splitlines()[0] if str(e).strip() else repr(e)
            kw = "pattern" if any(True for _ in find_keyword(schema, "pattern")) else None
            paths = list(find_keyword(schema, kw)) if kw else [""]
            raise SchemaError([SchemaProblem(p, f"outlines cannot build an index: {first}", kw)
                               for p in paths]) from None
        return OutlinesGrammar(self, regex, index)


# ----------------------------------------------------------------------------- schema checks

_ERROR_KEYWORDS = [
    (re.compile(r"^Format (.*) is not supported"), "format"),
    (re.compile(r"reference|Ref recusion|recursion"), "$ref"),
    (re.compile(r"Unsupported type|'type' must be"), "type"),
    (re.compile(r"enum"), "enum"),
    (re.compile(r"const"), "const"),
    (re.compile(r"maxLength|minLength"), "maxLength"),
    (re.compile(r"allOf"), "allOf"),
    (re.compile(r"anyOf"), "anyOf"),
    (re.compile(r"oneOf"), "oneOf"),
    (re.compile(r"prefixItems"), "prefixItems"),
    (re.compile(r"properties"), "properties"),
]


def _problems_from_message(schema: dict, message: str) -> list[SchemaProblem]:
    first = message.strip().splitlines()[0] if message.strip() else "outlines cannot compile the schema"
    for pattern, kw in _ERROR_KEYWORDS:
        if pattern.search(first):
            paths = list(find_keyword(schema, kw)) or [""]
            return [SchemaProblem(p, first, kw) for p in paths]
    return [SchemaProblem("", first, None)]


# Keywords that constrain instances (JSON Schema validation + applicators). Anything
# else (title, description, default, $defs, ...) is an annotation outlines may ignore.
_VALIDATION_KEYWORDS = {
    "type", "enum", "const", "multipleOf", "maximum", "exclusiveMaximum", "minimum",
    "exclusiveMinimum", "maxLength", "minLength", "pattern", "format", "maxItems", "minItems",
    "uniqueItems", "maxContains", "minContains", "contains", "maxProperties", "minProperties",
    "required", "dependentRequired", "dependencies", "dependentSchemas", "properties",
    "patternProperties", "additionalProperties", "propertyNames", "items", "prefixItems",
    "additionalItems", "allOf", "anyOf", "oneOf", "not", "if", "then", "else",
    "unevaluatedItems", "unevaluatedProperties", "$ref", "$dynamicRef", "$recursiveRef",
}
# The order in which outlines_core's parser picks the one keyword it translates.
_DISPATCH = ["properties", "allOf", "anyOf", "oneOf", "prefixItems", "enum", "const", "$ref", "type"]
_SOUND_FORMATS = {"date-time", "date", "time", "uuid"}
_JSON_TYPES = {"string", "number", "integer", "array", "object", "boolean", "null"}


def _unsafe_char(c: int) -> bool:
    """Characters that cannot appear raw inside a JSON string."""
    return c in (0x22, 0x5C) or c < 0x20


def pattern_problem(pattern: Any) -> str | None:
    """Why outlines cannot enforce `pattern` soundly, or None.

    outlines pastes `pattern` between the quotes of the string regex (stripping ^...$
    when both are present) and matches it against the raw JSON text, so anything that
    can match '"', '\\' or a control character would produce invalid JSON. Checked on
    Python's parse of the pattern; what it cannot parse is refused.
    """
    if not isinstance(pattern, str):
        return "'pattern' must be a string"
    body = pattern[1:-1] if pattern.startswith("^") and pattern.endswith("$") and len(pattern) > 1 else pattern
    try:
        from re import _parser as sre_parse  # Python 3.11+
        tree = sre_parse.parse(body)
    except Exception as e:  # noqa: BLE001 - any parse failure means "refuse"
        return f"cannot parse pattern: {e}"
    from re import _constants as C

    def walk(items) -> str | None:
        for op, av in items:
            if op is C.LITERAL:
                if _unsafe_char(av):
                    return f"pattern matches {chr(av)!r} literally"
            elif op in (C.NOT_LITERAL, C.ANY):
                return "pattern uses '.' or a negated character, which can match '\"' or '\\'"
            elif op is C.IN:
                for iop, iav in av:
                    if iop is C.NEGATE:
                        return "pattern uses a negated class [^...], which can match '\"' or '\\'"
                    if iop is C.LITERAL and _unsafe_char(iav):
                        return f"pattern class contains {chr(iav)!r}"
                    if iop is C.RANGE and any(_unsafe_char(x) for x in range(iav[0], min(iav[1], 0x5C) + 1)):
                        return f"pattern range {chr(iav[0])!r}-{chr(iav[1])!r} contains '\"', '\\' or controls"
                    if iop is C.CATEGORY and iav not in (C.CATEGORY_DIGIT, C.CATEGORY_WORD):
                        return "pattern uses \\s, \\S, \\D or \\W, which match '\"', '\\' or controls"
            elif op is C.CATEGORY:
                return "pattern uses a character category outlines cannot bound"
            elif op is C.SUBPATTERN:
                r = walk(av[-1])
                if r:
                    return r
            elif op in (C.MAX_REPEAT, C.MIN_REPEAT, C.POSSESSIVE_REPEAT):
                r = walk(av[2])
                if r:
                    return r
            elif op is C.BRANCH:
                for alt in av[1]:
                    r = walk(alt)
                    if r:
                        return r
            elif op is C.AT:
                return ("pattern has an anchor other than a leading ^ with a trailing $; outlines "
                        "matches the whole string, so only fully anchored or unanchored patterns work")
            else:  # lookaround, backreferences, conditionals, atomic groups, ...
                return f"pattern uses {op}, which outlines' regex engine does not support"
        return None

    return walk(tree)


def unsupported_problems(schema: Any) -> list[SchemaProblem]:
    """Every place where outlines would not enforce `schema` exactly.

    Mirrors outlines_core's translator: per schema object it translates only the
    first keyword of `_DISPATCH` present and ignores the rest. Restrictions (outlines
    forbids extra properties, emits properties in declaration order, caps nesting of
    unconstrained values) are accepted, since they keep the output valid.
    """
    problems: list[SchemaProblem] = []
    _check(schema, (), schema, [], problems)
    return problems


def _type_ok(value: Any, types: list[str]) -> bool:
    for t in types:
        if (t == "string" and isinstance(value, str)
                or t == "boolean" and isinstance(value, bool)
                or t == "null" and value is None
                or t == "integer" and isinstance(value, int) and not isinstance(value, bool)
                or t == "integer" and isinstance(value, float) and value.is_integer()
                or t == "number" and isinstance(value, (int, float)) and not isinstance(value, bool)):
            return True
    return False


def _needs_json_escape(s: str) -> bool:
    return any(c in '"\\' or ord(c) < 0x20 or 0x7F <= ord(c) <= 0x9F for c in s)


def _resolve(root: Any, ref: str) -> tuple[Any, tuple] | None:
    parts = ref.split("#")
    if len(parts) == 2 and parts[0] and not (isinstance(root, dict) and parts[0] == root.get("$id")):
        return None
    if len(parts) > 2:
        return None
    frag = parts[-1]
    path = tuple(p for p in frag.split("/") if p)
    node = root
    for p in path:
        if isinstance(node, dict) and p in node:
            node = node[p]
        else:
            return None
    return node, path


def _check(node: Any, path: tuple, root: Any, refs: list[str], out: list[SchemaProblem]) -> None:
    here = pointer(path)

    def bad(keyword: str | None, message: str) -> None:
        out.append(SchemaProblem(pointer(path + ((keyword,) if keyword else ())), message, keyword))

    if not isinstance(node, dict):
        bad(None, "boolean (or non-object) subschemas are not supported by outlines")
        return
    if not node:
        return  # {}: any JSON value
    present = [k for k in _DISPATCH if k in node]
    if not present:
        unenforced = [k for k in node if k in _VALIDATION_KEYWORDS]
        for kw in unenforced:
            bad(kw, f"keyword {kw!r} is not supported by the outlines backend")
        if not unenforced:  # only annotations: outlines rejects it (use {} for "anything")
            out.append(SchemaProblem(here, "the outlines backend needs one of "
                                     + ", ".join(_DISPATCH) + " here", None))
        return
    branch = present[0]
    types: list[str] = []
    if "type" in node:
        raw = node["type"]
        types = [raw] if isinstance(raw, str) else list(raw) if isinstance(raw, list) else []
    honoured: set[str] = {branch}

    if branch == "properties":
        props = node["properties"]
        honoured |= {"required", "additionalProperties"}
        if types and "object" in types:
            honoured.add("type")
        if not isinstance(props, dict):
            bad("properties", "'properties' must be an object")
            return
        required = node.get("required", [])
        missing = [r for r in required if r not in props] if isinstance(required, list) else []
        if missing:
            bad("required", f"required properties {missing} are not in 'properties'; "
                "outlines would never emit them")
        for name, sub in props.items():
            if _needs_json_escape(name):
                bad("properties", f"property name {name!r} needs JSON escaping, which outlines "
                    "does not do")
            _check(sub, path + ("properties", name), root, refs, out)
    elif branch in ("allOf", "anyOf", "oneOf", "prefixItems"):
        subs = node[branch]
        if branch == "prefixItems":
            honoured |= {"items", "additionalItems"}
            if "array" in types:
                honoured.add("type")
            n = len(subs) if isinstance(subs, list) else 0
            lo, hi = node.get("minItems", 0), node.get("maxItems", n)
            if isinstance(lo, int) and lo > n:
                bad("minItems", "outlines always emits exactly len(prefixItems) items")
            if isinstance(hi, int) and hi < n:
                bad("maxItems", "outlines always emits exactly len(prefixItems) items")
            honoured |= {"minItems", "maxItems"}
        if not isinstance(subs, list):
            bad(branch, f"'{branch}' must be an array")
            return
        if branch == "allOf" and len(subs) != 1:
            bad("allOf", "outlines concatenates allOf branches; only a single-entry allOf "
                "is supported")
        if branch == "oneOf":  # the conformance runner saw outlines accept values no branch allows
            bad("oneOf", "outlines does not enforce oneOf exactly (it can accept a value that matches "
                "no branch or several); use the llguidance backend")
            return
        for i, sub in enumerate(subs):
            if sub == {} and branch in ("prefixItems", "anyOf"):
                bad(branch, f"an unconstrained ({{}}) {branch} entry lets outlines accept values the schema "
                    "refuses (seen: extra array items); give the entry a type")
                continue
            _check(sub, path + (branch, i), root, refs, out)
    elif branch in ("enum", "const"):
        values = node[branch] if branch == "enum" else [node[branch]]
        if not isinstance(values, list):
            bad(branch, "'enum' must be an array")
            return
        for v in values:
            if isinstance(v, (dict, list)):
                bad(branch, f"outlines supports only scalar {branch} values, not {json.dumps(v)}")
                break
        if types:
            honoured.add("type")
            if not all(_type_ok(v, types) for v in values):
                bad("type", f"some {branch} values do not match 'type' {types}")
    elif branch == "$ref":
        ref = node["$ref"]
        if not isinstance(ref, str):
            bad("$ref", "'$ref' must be a string")
            return
        if ref in refs:
            bad("$ref", f"recursive $ref {ref!r}: outlines unrolls recursion only 3 levels and "
                "silently drops what is deeper")
            return
        target = _resolve(root, ref)
        if target is None:
            bad("$ref", f"cannot resolve $ref {ref!r} (outlines supports local '#/...' refs only)")
            return
        _check(target[0], target[1], root, refs + [ref], out)
    else:  # type
        if not types or not all(isinstance(t, str) for t in types):
            bad("type", "'type' must be a string or an array of strings")
            return
        for t in types:
            if t not in _JSON_TYPES:
                bad("type", f"unsupported type {t!r}")
        for t in types:
            honoured |= _check_type(t, node, path, root, refs, out, bad)
        if "string" not in types:
            honoured.add("format")  # an annotation on non-strings (int32, ...)

    for kw in node:
        if kw in _VALIDATION_KEYWORDS and kw not in honoured:
            reason = ("is ignored next to '" + branch + "'" if kw in _DISPATCH
                      else "is not enforced by the outlines backend")
            bad(kw, f"keyword {kw!r} {reason}")


def _check_type(t: str, node: dict, path: tuple, root, refs, out, bad) -> set[str]:
    """Check one `type` branch; return the keywords outlines honours for it."""
    if t == "string":
        if "maxLength" in node or "minLength" in node:
            for kw in ("minLength", "maxLength"):
                v = node.get(kw)
                if isinstance(v, int) and v > MAX_STRING_LENGTH_BOUND:
                    bad(kw, f"{kw} {v} > {MAX_STRING_LENGTH_BOUND}: outlines' index build grows "
                        "exponentially with string length bounds")
            return {"minLength", "maxLength"}
        if "pattern" in node:
            why = pattern_problem(node["pattern"])
            if why:
                bad("pattern", why)
            return {"pattern"}
        if "format" in node:
            f = node["format"]
            if f not in _SOUND_FORMATS:
                bad("format", f"format {f!r} is not supported by the outlines backend "
                    f"(supported: {sorted(_SOUND_FORMATS)})")
            return {"format"}
        return set()
    if t in ("number", "integer", "boolean", "null"):
        return set()
    if t == "array":
        items = node.get("items")
        if items is not None:
            if isinstance(items, dict):
                _check(items, path + ("items",), root, refs, out)
            else:
                bad("items", "'items' must be a schema object for outlines")
        return {"items", "minItems", "maxItems"}
    if t == "object":
        ap = node.get("additionalProperties")
        if isinstance(ap, dict):
            _check(ap, path + ("additionalProperties",), root, refs, out)
        elif ap is False:
            # outlines treats `false` like `true` here (any properties): not enforced.
            bad("additionalProperties", "'additionalProperties: false' without 'properties' "
                "is not enforced by outlines")
        return {"additionalProperties", "minProperties", "maxProperties"}
    return set()
