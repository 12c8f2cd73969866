"""What every proposer sees and promises."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Protocol

from structspec.engine.tokens import TokenText
from structspec.grammar import Matcher


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
        doc_len, doc_end = longest_suffix_match(self.text, tail, self.min_match, self.max_match)
        # An earlier occurrence in the output: search all but the last character.
        out_len, out_end = longest_suffix_match(tail[:-1], tail, self.min_match, self.max_match)
        if doc_len and doc_len >= out_len:
            return self.text[doc_end:doc_end + n_chars]
        if out_len:
            return tail[out_end:out_end + n_chars]
        return ""

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

    def end_of(self, value: str) -> int:
        """Where the first occurrence of `value` ends in the document (0 if absent)."""
        i = self.text.find(value) if value else -1
        return i + len(value) if i >= 0 else 0


MAX_OCCURRENCES = 256  # of one value in one document; a 4.5k-char document rarely has 20


@dataclass
class StringState:
    """Where a JSON prefix ends relative to strings."""

    value: str | None  # escaped content so far of the string *value* the prefix ends in, else None
    previous: str  # escaped content of the last complete string value before that ("" if none)


def string_state(text: str) -> StringState:
    """Scan the JSON prefix `text` (grammar-valid, so well formed so far)."""
    stack: list[str] = []  # "{" / "["
    expect_key = False  # inside an object, before the next ":"
    in_string = escaped = False
    start = 0
    is_value = False
    previous = ""
    for i, ch in enumerate(text):
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
                if is_value and i > start:
                    previous = text[start:i]
            continue
        if ch == '"':
            in_string, start = True, i + 1
            is_value = not (stack and stack[-1] == "{" and expect_key)
        elif ch in "{[":
            stack.append(ch)
            expect_key = ch == "{"
        elif ch in "}]":
            if stack:
                stack.pop()
            expect_key = False
        elif ch == ",":
            expect_key = bool(stack) and stack[-1] == "{"
        elif ch == ":":
            expect_key = False
    value = text[start:] if in_string and is_value else None
    return StringState(value=value, previous=previous)


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


class Proposer(Protocol):
    name: str

    def propose(self, ctx: DraftContext, k: int) -> list[int]:
        """Up to `k` draft tokens continuing the output. Never changes `ctx.matcher`."""
