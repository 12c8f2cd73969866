"""The loop guard: an output that has started repeating itself is ended there, as truncated,
instead of burning tokens to max_tokens.

Small models fall into loops under a grammar that allows them to go on: the same array item
written again and again ("Almond croissant" twenty times), or the same key and value pattern.
Once the last R blocks of P tokens are identical (R = `repeats`, P up to MAX_PERIOD, and the
repeated run at least MIN_TOKENS long), the output is cut after that run and reported as
`truncated` (stop reason `repetition`), naming P and R.

The rule is a function of the output tokens alone, checked at every position, so it defines
what constrained decoding produces: `none` and every speculative strategy stop at the same
token (a step that commits several tokens is cut at the first position where the rule holds).
A completed output (grammar end, EOS) at that very position stays a success.

What it does not catch: loops that vary (a counter in each item, new key names each time), and
a legitimate run of identical items (a receipt listing the same article on four lines) is
stopped too; STRUCTSPEC_ENGINE_LOOP_REPEATS=0 turns the guard off.
"""

from __future__ import annotations

MAX_PERIOD = 128  # longest repeated block looked for, in tokens
MIN_TOKENS = 48  # shortest repeated run that counts (repeats x period)


class LoopGuard:
    """Per sequence: for each period P, how many tokens in a row equal the token P before."""

    def __init__(self, repeats: int):
        self.repeats = repeats
        self.runs = [0] * (MAX_PERIOD + 1)
        self.seen = 0  # output tokens fed so far
        self.period = 0  # the period that fired

    def feed(self, out: list[int]) -> int | None:
        """Scan the tokens of `out` not fed yet; the output length at which the rule first
        holds (the run ends there), or None."""
        runs, repeats = self.runs, self.repeats
        for i in range(self.seen, len(out)):
            token = out[i]
            for p in range(1, min(MAX_PERIOD, i) + 1):
                if out[i - p] == token:
                    runs[p] += 1
                    if runs[p] >= p * (repeats - 1) and p * repeats >= MIN_TOKENS:
                        self.seen, self.period = i + 1, p
                        return i + 1
                else:
                    runs[p] = 0
        self.seen = len(out)
        return None
