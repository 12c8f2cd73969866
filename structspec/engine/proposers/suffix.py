"""Drafts learned from a schema's earlier outputs: the most frequent continuation of the tail.

Extraction repeats itself: every output of one schema has the same keys in the same order, the
same layout and punctuation, often the same formats and recurring values. A `SuffixIndex` holds
the token ids of a schema's recent succeeded outputs; given the current output's tail it finds
the longest suffix of that tail that occurred before, and drafts the continuation most of those
occurrences agree on.

The index is one string per schema in which each token id is one code point (id + 1; code point
0 separates outputs and stands for "the output starts here" in a tail). Why not a suffix tree:
a Python tree costs hundreds of bytes per node and the number of nodes grows with the square of
the match depth over novel text, where this costs 2-4 bytes a token, appends in O(1), evicts
the oldest outputs by slicing, and does its searching in C (`str` search). A lookup is a binary
search over suffix lengths (a suffix that occurs implies that all its shorter suffixes do), each
probe one substring search over the index; the per-schema budget keeps that scan short. The
occurrences are then read most recent first (at most MAX_VOTES of them) and the draft follows,
token by token, the continuation most of them share, while at least MIN_SHARE of them agree
(where every voter left agrees, the whole shared stretch is taken at once: the vote is paid
only where they part).

Drafts only change speed: the target model verifies every token, so an output is what plain
constrained decoding of that document gives (identical except at near-ties), whatever the
index holds. Indexes are keyed by the caller (the worker: tenant and schema version), so one
tenant's outputs never draft another's (SuffixStore).
"""

from __future__ import annotations

import sys
from collections import Counter, OrderedDict
from dataclasses import dataclass

from structspec.engine.proposers.base import (DraftContext, consume_valid_prefix, layout, longest_suffix_match,
                                              note_confidence, split_at_hole)

SEP = "\x00"  # between outputs; at a tail's start: "the output begins here"
MAX_MATCH = 32  # tail items (tokens, layout characters) matched at most
MAX_VOTES = 32  # most recent occurrences of the matched tail that vote on the continuation
MIN_SHARE = 0.3  # the draft goes on while at least this share of the voters agree with it
MAX_TOKEN_ID = 0x10FFFE  # ids are code points id + 1


def _chars(tokens) -> str:
    return "".join(chr(t + 1) for t in tokens)


@dataclass(frozen=True)
class Found:
    """A continuation from an index and its evidence."""

    items: str  # the continuation (code points: token ids + 1, or layout characters)
    matched: int  # tail items the occurrences share (the start-of-output mark counts as one)
    votes: int  # occurrences of that tail that voted
    agreeing: int  # of them, those whose continuation begins with items[0]
    last: int = 0  # of them, those whose continuation begins with all of items

    @property
    def share(self) -> float:
        """How sure the draft is: the share of the voters that continue with all of it, drawn
        towards a half when there are few of them ((last + 1) / (votes + 2))."""
        return (self.last + 1) / (self.votes + 2)


@dataclass(frozen=True)
class Continuation:
    """A token draft from the index of earlier outputs and its evidence."""

    tokens: list[int]
    matched: int
    votes: int
    agreeing: int
    share: float = 0.0  # Found.share


class SuffixIndex:
    """Recent outputs as one string of items (at most `max_items` of them; the oldest outputs
    leave first), and the most agreed continuation of a tail's longest earlier match."""

    def __init__(self, max_items: int):
        self.max_items = max(1, max_items)
        self.text = SEP
        self.outputs = 0

    @property
    def items(self) -> int:
        return len(self.text) - self.outputs - 1

    @property
    def nbytes(self) -> int:
        return sys.getsizeof(self.text)

    def add(self, items: str) -> bool:
        """Add one output; False (nothing added) for an empty one or one over the budget alone."""
        if not items or len(items) > self.max_items or SEP in items:
            return False
        self.text += items + SEP
        self.outputs += 1
        if self.items > self.max_items:
            self.evict(self.max_items * 3 // 4)  # to 3/4: the slice is paid once per quarter of the budget
        return True

    def evict(self, keep_items: int) -> None:
        """Drop the oldest outputs until at most `keep_items` items remain (the newest stays)."""
        cut = dropped_items = dropped = 0  # cut: the separator before the oldest output kept
        while self.items - dropped_items > keep_items:
            nxt = self.text.find(SEP, cut + 1)
            if nxt < 0 or nxt == len(self.text) - 1:
                break
            dropped_items += nxt - cut - 1
            dropped += 1
            cut = nxt
        if cut:
            self.outputs -= dropped
            self.text = self.text[cut:]

    def follow(self, tail: str, budget: int, start: bool) -> Found | None:
        """Up to `budget` items continuing the longest suffix of `tail` (its last MAX_MATCH
        items; `start`: `tail` is the whole output so far, so its beginning must match an
        output's beginning) that occurred in an earlier output, as most of its most recent
        occurrences continue."""
        if budget <= 0 or self.outputs == 0:
            return None
        key = (SEP if start and len(tail) < MAX_MATCH else "") + tail[-MAX_MATCH:]
        matched, _ = longest_suffix_match(self.text, key, 1, MAX_MATCH)
        if not matched:
            return None
        needle = key[-matched:]
        ends: list[int] = []
        i = self.text.rfind(needle)
        while i >= 0 and len(ends) < MAX_VOTES:
            if i + matched < len(self.text):  # the last separator: nothing follows it
                ends.append(i + matched)
            i = self.text.rfind(needle, 0, i + matched - 1)
        voters = len(ends)
        # what follows each occurrence, up to the budget or the end of its output
        group = [self.text[e:e + budget].split(SEP, 1)[0] for e in ends]
        out: list[str] = []
        size = first = last = 0
        while size < budget and group:
            agree = _common_prefix(group)  # every voter left continues with these items
            if agree:
                ch, n = group[0][:min(agree, budget - size)], len(group)
            else:  # they part: the most common next item (a tie: the most recent, counted first)
                counts = Counter(c[0] for c in group if c)
                if not counts:
                    break
                ch, n = counts.most_common(1)[0]
            if n < MIN_SHARE * voters:  # of the first voters: the share agreeing with the whole draft
                break
            first, last = first or n, n
            out.append(ch)
            size += len(ch)
            group = [c[len(ch):] for c in group if c.startswith(ch)]
        return Found("".join(out), matched, voters, first, last) if out else None


def _common_prefix(strings: list[str]) -> int:
    """The length of the prefix every string of `strings` shares (that of the least and the
    greatest: the comparisons run in C, and so does the binary search's slicing)."""
    lo, hi = min(strings), max(strings)
    a, b = 0, min(len(lo), len(hi))
    while a < b:
        m = (a + b + 1) // 2
        if lo[:m] == hi[:m]:
            a = m
        else:
            b = m - 1
    return a


class History:
    """One key's (tenant + schema version) earlier outputs: their token ids, and their layout
    (`layout`: string contents and numbers as holes), which says what follows a value whatever
    the value was."""

    def __init__(self, max_tokens: int):
        self.tokens = SuffixIndex(max_tokens)
        self.layout = SuffixIndex(max_tokens)

    @property
    def outputs(self) -> int:
        return self.tokens.outputs

    @property
    def nbytes(self) -> int:
        return self.tokens.nbytes + self.layout.nbytes

    def learn(self, tokens: list[int], text: str) -> bool:
        if not tokens or max(tokens) > MAX_TOKEN_ID or min(tokens) < 0:
            return False
        if not self.tokens.add(_chars(tokens)):
            return False
        self.layout.add(layout(text))
        return True

    def evict(self, fraction: float) -> None:
        self.tokens.evict(int(self.tokens.items * fraction))
        self.layout.evict(int(self.layout.items * fraction))

    def continuation(self, tail: list[int], budget: int) -> Continuation | None:
        """The most agreed token continuation of the output `tail` (its token ids, from its start)."""
        recent = tail[-MAX_MATCH:]
        if recent and (max(recent) > MAX_TOKEN_ID or min(recent) < 0):
            return None
        found = self.tokens.follow(_chars(recent), budget, start=len(tail) < MAX_MATCH)
        if found is None:
            return None
        return Continuation([ord(c) - 1 for c in found.items], found.matched, found.votes, found.agreeing,
                            found.share)

    def layout_after(self, tail: str, start: bool, n_chars: int) -> tuple[str, str | None, float, int]:
        """(the text most earlier outputs continue a layout `tail` (JsonScan.layout; `start`:
        it is the output's whole layout) with, up to where a value's content begins (a string's
        opening quote included) or `n_chars`; the value that begins there: STRING_HOLE,
        NUMBER_HOLE or None; how sure that text is: Found.share, of the whole continuation, so at
        most what it is of the text; how many characters of `tail` the earlier outputs matched)."""
        found = self.layout.follow(tail, n_chars, start=start)
        if found is None:
            return "", None, 0.0, 0
        return *split_at_hole(found.items), found.share, found.matched


class SuffixStore:
    """Every key's History in one process, within a total byte budget (least recently used
    keys leave first) and a per-key token budget. Used from the engine's one thread."""

    def __init__(self, total_bytes: int, key_tokens: int):
        self.total_bytes = total_bytes
        self.key_tokens = key_tokens
        self._histories: OrderedDict[str, History] = OrderedDict()
        self._bytes: dict[str, int] = {}

    def __len__(self) -> int:
        return len(self._histories)

    def __contains__(self, key: str) -> bool:
        return key in self._histories

    @property
    def nbytes(self) -> int:
        return sum(self._bytes.values())

    def get(self, key: str) -> History:
        """The key's History (a new, empty one the first time), now the most recently used."""
        history = self._histories.get(key)
        if history is None:
            history = self._histories[key] = History(self.key_tokens)
            self._bytes[key] = history.nbytes
        self._histories.move_to_end(key)
        return history

    def learn(self, key: str, tokens: list[int], text: str) -> None:
        history = self.get(key)
        if history.learn(tokens, text):
            self._bytes[key] = history.nbytes
            self._fit(keep=key)

    def _fit(self, keep: str) -> None:
        while self.nbytes > self.total_bytes and len(self._histories) > 1:
            oldest = next(iter(self._histories))
            if oldest == keep:
                break
            del self._histories[oldest], self._bytes[oldest]
        if self.nbytes > self.total_bytes:  # one key alone over the total: it keeps what fits
            history = self._histories[keep]
            history.evict(self.total_bytes / self.nbytes)
            self._bytes[keep] = history.nbytes


def suffix_step(ctx: DraftContext, drafted: list[int], budget: int) -> list[int]:
    """Consume (into ctx.matcher) the grammar-valid prefix of the index's continuation of the
    output followed by `drafted`; return it (its share noted in ctx.confidence)."""
    found = suffix_continuation(ctx, drafted, budget)
    step = consume_valid_prefix(ctx.matcher, found.tokens) if found else []
    note_confidence(ctx, len(step), found.share if found else None)
    return step


def suffix_continuation(ctx: DraftContext, drafted: list[int], budget: int) -> Continuation | None:
    if ctx.history is None or budget <= 0:
        return None
    return ctx.history.continuation(ctx.output_tokens + drafted, budget)


class SuffixProposer:
    name = "suffix"

    def propose(self, ctx: DraftContext, k: int) -> list[int]:
        draft: list[int] = []
        try:
            draft = suffix_step(ctx, [], k)
        finally:
            ctx.matcher.rollback(len(draft))
        return draft
