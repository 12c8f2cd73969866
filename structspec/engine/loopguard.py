"""The loop guard: an output that has started repeating itself is ended there, as truncated,
instead of burning tokens to max_tokens.

Small models fall into loops under a grammar that allows them to go on: the same array item
written again and again ("Almond croissant" twenty times), the same key and value pattern, or
a string that counts ("Laguna_2018_2019_2020_..."). Two rules, each with R = `repeats`, a
period P up to MAX_PERIOD and a repeated run at least MIN_TOKENS long:

- identical: the last R blocks of P output tokens are the same tokens;
- counting: inside one JSON string, the last R blocks of P tokens are the same once every
  all-digit token counts as one symbol ("_2018" and "_2019" are the same shape). Only within
  a string, so arrays of numbers, whose items all have the same shape, never fire it.

The first position where either rule holds ends the output, which is reported as `truncated`
(stop reason `repetition`), naming the rule, P and R.

The rules are a function of the output tokens alone (and of their bytes, for strings and
digits), checked at every position, so they define what constrained decoding produces: `none`
and every speculative strategy stop at the same token (a step that commits several tokens is
cut at the first position where a rule holds). A completed output (grammar end, EOS) at that
very position stays a success.

What it does not catch: loops whose blocks differ by more than their digits (new key names
each time), and a legitimate run of identical items (a receipt listing the same article on
four lines) is stopped too, as is a string listing numbers of one shape at length (ten or more
"555-0101, 555-0102, ..."). STRUCTSPEC_ENGINE_LOOP_COUNTING=false turns the counting rule off,
STRUCTSPEC_ENGINE_LOOP_REPEATS=0 the whole guard.
"""

from __future__ import annotations

MAX_PERIOD = 128  # longest repeated block looked for, in tokens
MIN_TOKENS = 48  # shortest repeated run that counts (repeats x period)


DIGITS = -1  # the counting rule's symbol for any all-digit token


class LoopGuard:
    """Per sequence: for each period P, how many tokens in a row equal the token P before
    (identical rule), and the same over the token shapes of the current string (counting rule)."""

    def __init__(self, repeats: int, counting: bool = True):
        self.repeats = repeats
        self.counting = counting  # the counting rule on (it also needs token_bytes in feed)
        self.runs = [0] * (MAX_PERIOD + 1)
        self.seen = 0  # output tokens fed so far
        self.period = 0  # the period that fired
        self.rule = ""  # the rule that fired: "identical" or "counting"
        # the counting rule: the shapes of the current string's tokens, and the JSON lexer state
        self.shape_runs = [0] * (MAX_PERIOD + 1)
        self.shapes: list[int] = []
        self.in_string = False
        self.escaped = False

    def feed(self, out: list[int], token_bytes=None) -> int | None:
        """Scan the tokens of `out` not fed yet; the output length at which a rule first holds
        (the run ends there), or None. `token_bytes(ids) -> bytes` enables the counting rule."""
        for i in range(self.seen, len(out)):
            p = repeated(out, i, self.runs, self.repeats)
            if p:
                return self._fired(i, p, "identical")
            if self.counting and token_bytes is not None:
                p = self._shape(out[i], token_bytes([out[i]]))
                if p:
                    return self._fired(i, p, "counting")
        self.seen = len(out)
        return None

    def _fired(self, i: int, period: int, rule: str) -> int:
        self.seen, self.period, self.rule = i + 1, period, rule
        return i + 1

    def _shape(self, token: int, data: bytes) -> int:
        """Advance the counting rule over one token; the period that fired, or 0."""
        inside = self.in_string
        crossed = False
        for byte in data:
            if self.escaped:
                self.escaped = False
            elif byte == 0x5C and self.in_string:  # backslash
                self.escaped = True
            elif byte == 0x22:  # quote
                self.in_string = not self.in_string
                crossed = True
        if crossed or not inside:  # a token that opens or closes a string starts a new one
            if self.shapes:  # runs only move while shapes are recorded: nothing to reset otherwise
                self.shapes.clear()
                self.shape_runs = [0] * (MAX_PERIOD + 1)
            return 0
        self.shapes.append(DIGITS if data.isdigit() else token)
        return repeated(self.shapes, len(self.shapes) - 1, self.shape_runs, self.repeats)


def repeated(seq: list[int], i: int, runs: list[int], repeats: int) -> int:
    """Advance `runs` (per period P, how many items in a row equal the one P before) over
    seq[i]; the first period whose last `repeats` blocks are now equal, or 0."""
    item = seq[i]
    for p in range(1, min(MAX_PERIOD, i) + 1):
        if seq[i - p] == item:
            runs[p] += 1
            if runs[p] >= p * (repeats - 1) and p * repeats >= MIN_TOKENS:
                return p
        else:
            runs[p] = 0
    return 0
