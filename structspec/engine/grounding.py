"""Grounding a result in its document and in the model: where each string value occurs in the
document (character spans), and how sure the target model was of the tokens that wrote each
leaf value (confidence). Both are keyed by JSON Pointer (RFC 6901): "/company",
"/items/0/name".

Spans. A string value is looked up in the document as exact text. Of its occurrences the
nearest one after the previous string's span is taken, or, if there is none after, the nearest
before it: documents mostly list fields in the order the schema asks for them, so a value that
occurs several times (a total echoing a subtotal) is placed beside its neighbours. Occurrences
inside a longer word (the "b" of "label") are taken only when there is no other. A value that does not occur (a paraphrase, a normalised number) or an empty string maps to
null: not grounded. With verbatim decoding every non-empty string is a document span by
construction, so each gets its span.

Confidence. For each leaf (string, number, boolean, null) the probabilities the target gave,
under the grammar's mask, to the output tokens that wrote it: their minimum and mean. They
come from the logits of the verification pass that emitted the tokens, so speculation does not
change them beyond float noise. They measure the model's certainty about its own text, not
correctness: a model can be confidently wrong, and a forced token (the only one the grammar
allows) has probability 1.
"""

from __future__ import annotations

import json
from typing import Any, Iterator

Span = tuple[int, int]


def pointer(parts: list[str | int]) -> str:
    """The JSON Pointer of a path."""
    return "".join("/" + str(p).replace("~", "~0").replace("/", "~1") for p in parts)


def leaves(value: Any, path: list[str | int] | None = None) -> Iterator[tuple[str, Any]]:
    """(pointer, leaf) of every leaf (string, number, boolean, null) in `value`, in document
    order (object keys as written)."""
    path = path or []
    if isinstance(value, dict):
        for k, v in value.items():
            yield from leaves(v, [*path, k])
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from leaves(v, [*path, i])
    else:
        yield pointer(path), value


def string_leaves(value: Any) -> Iterator[tuple[str, str]]:
    """(pointer, string) of every string in `value`, in document order."""
    return ((ptr, v) for ptr, v in leaves(value) if isinstance(v, str))


def find_spans(document: str, value: Any) -> dict[str, list[int] | None]:
    """{pointer: [start, end) or None} for every string in `value`; see the module docstring."""
    out: dict[str, list[int] | None] = {}
    anchor = 0  # end of the previous grounded span
    for ptr, text in string_leaves(value):
        span = nearest(document, text, anchor) if text else None
        out[ptr] = list(span) if span else None
        if span:
            anchor = span[1]
    return out


def nearest(document: str, text: str, anchor: int) -> Span | None:
    """The first occurrence of `text` starting at or after `anchor`, else the last one before;
    an occurrence that is not part of a longer word (the "b" of "label") is preferred to one
    that is, wherever it is."""
    forward = _occurrences(document, text, anchor, len(document), reverse=False)
    backward = _occurrences(document, text, 0, anchor + len(text) - 1, reverse=True)  # starts < anchor
    fallback = None
    for found in (forward, backward):
        for start in found:
            if _whole(document, start, start + len(text)):
                return start, start + len(text)
            fallback = start if fallback is None else fallback
    return (fallback, fallback + len(text)) if fallback is not None else None


def _occurrences(document: str, text: str, lo: int, hi: int, reverse: bool) -> Iterator[int]:
    if reverse:
        while (at := document.rfind(text, lo, hi)) >= 0:
            yield at
            hi = at + len(text) - 1
    else:
        while (at := document.find(text, lo, hi)) >= 0:
            yield at
            lo = at + 1


def _whole(document: str, start: int, end: int) -> bool:
    """Whether document[start:end] does not cut a word: no letter or digit runs on past either end
    of a value that begins or ends with one."""
    before = start > 0 and document[start - 1].isalnum() and document[start].isalnum()
    after = end < len(document) and document[end].isalnum() and document[end - 1].isalnum()
    return not (before or after)


# --- leaves of the output text, with their positions ------------------------------------------

class _Scanner:
    """Positions (character offsets into the output text) of every leaf of a JSON text that
    json.loads accepts. Strings: the quotes included."""

    def __init__(self, text: str):
        self.text, self.i = text, 0
        self.leaves: list[tuple[str, int, int]] = []

    def ws(self) -> None:
        while self.i < len(self.text) and self.text[self.i] in " \t\r\n":
            self.i += 1

    def value(self, path: list[str | int]) -> None:
        self.ws()
        c = self.text[self.i]
        if c == "{":
            self.i += 1
            self.ws()
            if self.text[self.i] == "}":
                self.i += 1
                return
            while True:
                self.ws()
                start = self.i
                self.string_end()
                key = json.loads(self.text[start:self.i])
                self.ws()
                self.i += 1  # ':'
                self.value([*path, key])
                self.ws()
                c = self.text[self.i]
                self.i += 1
                if c == "}":
                    return
        elif c == "[":
            self.i += 1
            self.ws()
            if self.text[self.i] == "]":
                self.i += 1
                return
            n = 0
            while True:
                self.value([*path, n])
                n += 1
                self.ws()
                c = self.text[self.i]
                self.i += 1
                if c == "]":
                    return
        else:
            start = self.i
            if c == '"':
                self.string_end()
            else:
                while self.i < len(self.text) and self.text[self.i] not in ",]} \t\r\n":
                    self.i += 1
            self.leaves.append((pointer(path), start, self.i))

    def string_end(self) -> None:
        self.i += 1  # opening quote
        while self.text[self.i] != '"':
            self.i += 2 if self.text[self.i] == "\\" else 1
        self.i += 1


def leaf_positions(text: str) -> list[tuple[str, int, int]]:
    """(pointer, start, end) in `text` of every leaf value of the JSON text `text`."""
    scanner = _Scanner(text)
    scanner.value([])
    return scanner.leaves


def confidences(text: str, token_bytes: list[bytes], probs: list[float]) -> dict[str, dict[str, float]]:
    """{pointer: {"min", "mean"}} of the probabilities of the tokens that overlap each leaf's
    text (a string's quotes count when it is empty). `token_bytes[i]` is output token i's
    bytes, `probs[i]` the probability it was given; `text` is their decoded concatenation."""
    # character offset where each token starts (a token may end inside a UTF-8 character)
    starts, pos, buffer = [], 0, b""
    for raw in token_bytes:
        starts.append(pos)
        buffer += raw
        decoded = buffer.decode("utf-8", errors="ignore")
        pos += len(decoded)
        buffer = buffer[len(decoded.encode("utf-8")):]
    starts.append(len(text))
    out = {}
    for ptr, start, end in leaf_positions(text):
        if text[start] == '"' and end - start > 2:
            start, end = start + 1, end - 1  # the content; its quotes usually share its tokens
        ps = [p for i, p in enumerate(probs[:len(token_bytes)]) if starts[i] < end and starts[i + 1] > start]
        if ps:
            out[ptr] = {"min": round(min(ps), 4), "mean": round(sum(ps) / len(ps), 4)}
    return out
