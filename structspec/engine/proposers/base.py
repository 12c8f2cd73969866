"""What every proposer sees and promises."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from structspec.engine.tokens import TokenText
from structspec.grammar import Matcher

if TYPE_CHECKING:
    from structspec.engine.proposers.suffix import History


def longest_suffix_match(haystack: str, tail: str, lo: int, hi: int) -> tuple[int, int]:
    """(length, end index in haystack) of the longest suffix of `tail`, lo..hi chars long,
    that occurs in `haystack`; (0, -1) when even `lo` chars do not occur."""
    hi = min(hi, len(tail))
    if hi < lo or tail[-lo:] not in haystack:
        return 0, -1
    best = lo
    # A suffix that occurs implies all its shorter suffixes occur: binary search works.
    low, high = lo + 1, hi
    while low <= high:
        mid = (low + high) // 2
        if tail[-mid:] in haystack:
            best, low = mid, mid + 1
        else:
            high = mid - 1
    return best, haystack.find(tail[-best:]) + best


class DocumentIndex:
    """Prompt lookup over the document and the output so far.

    Extraction output copies document spans into JSON strings, so the document is kept
    JSON-escaped (quotes, backslashes and newlines escaped, unicode as is). Matching is
    on characters, not token ids: a value's first token ("Elena") is often a different
    id from the same word in running text (" Elena"), which token-level lookup misses.
    The output itself is searched too: repeated structure and the loops small models fall
    into are predicted from it.
    """

    def __init__(self, document: str, min_match: int = 3, max_match: int = 64):
        self.text = json.dumps(document, ensure_ascii=False)[1:-1]
        self.min_match = min_match
        self.max_match = max_match

    def continuation(self, tail: str, n_chars: int) -> str:
        """Up to `n_chars` of text likely to follow `tail` ("" when nothing matches)."""
        return self.lookup(tail, n_chars)[1]

    def lookup(self, tail: str, n_chars: int) -> tuple[int, str]:
        """(characters of `tail` matched, up to `n_chars` of what followed them); (0, "") when
        nothing matches. The document's match wins a tie with the output's own."""
        doc_len, doc_end = longest_suffix_match(self.text, tail, self.min_match, self.max_match)
        # An earlier occurrence in the output: search all but the last character.
        out_len, out_end = longest_suffix_match(tail[:-1], tail, self.min_match, self.max_match)
        if doc_len and doc_len >= out_len:
            return doc_len, self.text[doc_end:doc_end + n_chars]
        if out_len:
            return out_len, tail[out_end:out_end + n_chars]
        return 0, ""

    def spans(self, value: str, n_chars: int, after: int = 0, limit: int = 4) -> list[str]:
        """Distinct continuations (up to `n_chars` each) of `value` at the places it occurs
        in the document; occurrences starting at or after `after` come first, since fields
        are usually extracted in the document's order."""
        starts = []
        i = self.text.find(value)
        while i != -1 and len(starts) < MAX_OCCURRENCES:
            starts.append(i)
            i = self.text.find(value, i + 1)
        starts.sort(key=lambda s: (s < after, s))
        out: list[str] = []
        for s in starts:
            text = self.text[s + len(value):s + len(value) + n_chars]
            if text and text not in out:
                out.append(text)
                if len(out) == limit:
                    break
        return out

    def after_value(self, value: str, before: str, n_chars: int) -> str:
        """Up to `n_chars` of the document after `value` (its first occurrence after the first one
        of `before`, the value written before it, else its first), past the blanks and line breaks
        that end it: where the next value usually is in a document of lines and columns, since
        fields and array items are mostly extracted in the document's order ("" when `value` is
        shorter than MIN_VALUE, absent, or followed by something else: "2023, directed by")."""
        if len(value) < MIN_VALUE:
            return ""
        i = self.text.find(value, self.end_of(before))
        if i < 0:
            i = self.text.find(value)
            if i < 0:
                return ""
        start = BLANKS.match(self.text, i + len(value)).end()
        return self.text[start:start + n_chars] if start > i + len(value) else ""

    def number_after(self, number: str) -> str:
        """The first number in the document after the first occurrence of `number` ("" if none):
        a column of prices is extracted in its order whatever is written beside each."""
        i = self.text.find(number) if number else -1
        found = NUMBER_IN_TEXT.search(self.text, i + len(number)) if i >= 0 else None
        return found.group() if found else ""

    def end_of(self, value: str) -> int:
        """Where the first occurrence of `value` ends in the document (0 if absent)."""
        i = self.text.find(value) if value else -1
        return i + len(value) if i >= 0 else 0


MAX_OCCURRENCES = 256  # of one value in one document; a 4.5k-char document rarely has 20
MIN_VALUE = 2  # after_value: a one-character value occurs everywhere
BLANKS = re.compile(r"(?:[ \t]|\\[nrt])*")  # in the JSON-escaped document
NUMBER = re.compile(r"-?[0-9]+(?:\.[0-9]+)?")  # a number as a document writes one
# one standing alone in the JSON-escaped document (not part of a word: "P120", "SPF50")
NUMBER_IN_TEXT = re.compile(r"(?:(?<=\\[nrt])|(?<![\w.]))" + NUMBER.pattern)


@dataclass
class StringState:
    """Where a JSON prefix ends relative to strings."""

    value: str | None  # escaped content so far of the string *value* the prefix ends in, else None
    previous: str  # escaped content of the last complete string value before that ("" if none)


STRING_HOLE, NUMBER_HOLE = "\x01", "\x02"  # a string value's content, a number, in a layout
LAYOUT_KEPT = 1024  # characters of the layout a JsonScan keeps: an output's own earlier layout is matched
# (composite.py), the suffix proposer matches the last 32
NUMBER_CHARS = frozenset("0123456789.-+eE")
HOLE = re.compile(f"[{STRING_HOLE}{NUMBER_HOLE}]")


def split_at_hole(layout_text: str) -> tuple[str, str | None]:
    """(a layout's text up to where the next value's content begins, a string's opening quote
    included; the hole there: STRING_HOLE, NUMBER_HOLE, or None where the text holds none)."""
    hole = HOLE.search(layout_text)
    return (layout_text, None) if hole is None else (layout_text[:hole.start()], hole.group())


class JsonScan:
    """An incremental scan of a JSON prefix (grammar-valid, so well formed so far): where it
    stands relative to strings, and the end of its layout, the same text with each string
    value's content as STRING_HOLE and each number as NUMBER_HOLE (keys, punctuation,
    whitespace and literals kept). `feed` appends text; `copy` forks the scan, so a proposer
    scans a sequence's output once and only its draft after that."""

    __slots__ = ("stack", "expect_key", "in_string", "escaped", "is_value", "in_number", "value", "previous",
                 "number", "last", "before_last", "last_number", "at_value", "layout", "layout_len", "keep")

    def __init__(self, keep: int = LAYOUT_KEPT) -> None:
        self.keep = keep  # characters of the layout kept
        self.stack: list[str] = []  # "{" / "["
        self.expect_key = False  # inside an object, before the next ":"
        self.in_string = self.escaped = self.is_value = self.in_number = False
        self.value: list[str] = []  # the content so far of the string value being scanned
        self.previous = ""  # the last complete string value
        self.number: list[str] = []  # the characters so far of the number being scanned
        self.last = self.before_last = ""  # the last two complete values (a string's content, a number)
        self.last_number = ""  # the last complete number
        self.at_value = False  # a value comes next (after ":", "[" or an array's ",", and whitespace)
        self.layout = ""  # its last `keep` characters
        self.layout_len = 0

    def copy(self) -> "JsonScan":
        other = JsonScan.__new__(JsonScan)
        for name in JsonScan.__slots__:
            setattr(other, name, getattr(self, name))
        other.stack, other.value, other.number = list(self.stack), list(self.value), list(self.number)
        return other

    @property
    def state(self) -> StringState:
        return StringState(value="".join(self.value) if self.in_string and self.is_value else None,
                           previous=self.previous)

    def feed(self, text: str) -> "JsonScan":
        out: list[str] = []
        for ch in text:
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif ch == "\\":
                    self.escaped = True
                elif ch == '"':
                    self.in_string = False
                    out.append(ch)
                    if self.is_value and self.value:
                        self.previous = "".join(self.value)
                        self.before_last, self.last = self.last, self.previous
                    continue
                if self.is_value:
                    self.value.append(ch)
                else:
                    out.append(ch)
                continue
            if self.in_number:
                if ch in NUMBER_CHARS:
                    self.number.append(ch)
                    continue
                self.in_number = False
                self.before_last, self.last = self.last, "".join(self.number)
                self.last_number = self.last
            if ch not in " \t\n\r":
                self.at_value = ch in ":[" or ch == "," and bool(self.stack) and self.stack[-1] == "["
            if ch == '"':
                self.in_string = True
                self.is_value = not (self.stack and self.stack[-1] == "{" and self.expect_key)
                out.append(ch)
                if self.is_value:
                    self.value = []
                    out.append(STRING_HOLE)
                continue
            if ch == "-" or ch.isdigit() and ch.isascii():
                self.in_number = True
                self.number = [ch]
                out.append(NUMBER_HOLE)
                continue
            if ch in "{[":
                self.stack.append(ch)
                self.expect_key = ch == "{"
            elif ch in "}]":
                if self.stack:
                    self.stack.pop()
                self.expect_key = False
            elif ch == ",":
                self.expect_key = bool(self.stack) and self.stack[-1] == "{"
            elif ch == ":":
                self.expect_key = False
            out.append(ch)
        if out:
            added = "".join(out)
            self.layout = (self.layout + added)[-self.keep:]
            self.layout_len += len(added)
        return self


def string_state(text: str) -> StringState:
    """Scan the JSON prefix `text` (grammar-valid, so well formed so far)."""
    return JsonScan().feed(text).state


def layout(text: str) -> str:
    """The layout of `text` (JSON, or the start of it; JsonScan), whole: at most two characters
    a character of `text` (a one-character string value gains its hole)."""
    return JsonScan(keep=2 * len(text) + 1).feed(text).layout


def scan_of(ctx: "DraftContext", tail: str) -> JsonScan:
    """A scan of `tail` (the output so far, then a draft's text): the output's scan is kept in
    `ctx` and extended as the output grows; only the rest is scanned again."""
    out = ctx.output_text.rstrip("\ufffd")  # a partial UTF-8 character at the end may still change
    prefix, scan = ctx.scanned
    if not out.startswith(prefix):
        prefix, scan = "", JsonScan()
    if len(out) > len(prefix):
        scan = scan.copy().feed(out[len(prefix):])
        prefix = out
        ctx.scanned = (prefix, scan)
    if not tail.startswith(prefix):
        return JsonScan().feed(tail)
    return scan.copy().feed(tail[len(prefix):])


def consume_valid_prefix(matcher: Matcher, tokens: list[int]) -> list[int]:
    """Advance `matcher` over the longest grammar-valid prefix of `tokens`; return that prefix."""
    tokens = tokens[:matcher.validate(tokens)]
    if tokens and not matcher.consume(tokens):
        raise RuntimeError(f"grammar refused validated tokens: {matcher.error()}")
    return tokens


@dataclass
class DraftContext:
    """State a proposer may read. The matcher must be left exactly as found."""

    matcher: Matcher
    output_text: str  # the text generated so far
    document: DocumentIndex
    tokens: TokenText
    verbatim: bool = False  # some string values of the grammar can only be document spans
    output_tokens: list[int] = field(default_factory=list)  # the tokens generated so far (the sequence's own list)
    history: "History | None" = None  # earlier outputs of this schema and tenant (suffix.py), if kept
    scanned: tuple[str, JsonScan] = field(default_factory=lambda: ("", JsonScan()))  # scan_of's: the output's
    # how sure the proposer is of each token it drafted (None: no more than its schema's average
    # acceptance says); the engine empties it before each proposal and the batch's draft plan
    # reads it (engine/cost.py). A learned stretch puts its Found.share on its first token and
    # 1.0 on the rest: the plan's product over a draft's prefix then holds the stretch's share.
    confidence: list[float | None] = field(default_factory=list)


def note_confidence(ctx: DraftContext, n: int, share: float | None) -> None:
    """Record how sure a stretch of `n` drafted tokens is (DraftContext.confidence)."""
    if n > 0:
        ctx.confidence += [share] + [None if share is None else 1.0] * (n - 1)


class Proposer(Protocol):
    name: str

    def propose(self, ctx: DraftContext, k: int) -> list[int]:
        """Up to `k` draft tokens continuing the output. Never changes `ctx.matcher`."""
