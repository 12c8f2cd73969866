"""How well a proposer drafts, without timing: its drafts replayed over known outputs.

    python -m bench.drafts [--dataset receipts|PATH] [--n 32] [--max-tokens 256]
                           [--strategies composite:8,composite:16,ngram:16] [--memory] [--misses 0]

The batched engine runs the documents once with `none`: the outputs every strategy reproduces
(identical except at near-ties). Then each strategy walks each output as verification does: at
each pass the proposer drafts up to k tokens from the output so far (cut at the first token the
grammar refuses), the longest prefix of the draft that the output continues with is accepted,
and one more token is the target's. Per strategy: passes (the most any document needs, which
is how many steps a batch of these documents takes; their sum; the median), rows (a pass's
1 + draft, summed: what the forward passes compute) and tokens per pass. `--memory`: each
strategy drafts from a memory of earlier outputs (suffix.py) that learns the succeeded outputs
in order, as a worker learns finished jobs one after another. `--misses N`: the first N places
where a draft and the output part, per strategy (the output before, the draft, the output).

For a fixed strategy the walk is the engine's own (its passes equal a batched run's
`target_passes` where the outputs are the same); `auto`'s draft plan also trims drafts to what
pays in each pass (engine/cost.py), which this does not. The figures do not depend on the
host's speed or on what else runs (only on the outputs, which the dtype can change), so a change
to a proposer can be measured without this machine's noise; what a pass costs is `bench.peer`'s
and `bench.passes`' question.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from dataclasses import dataclass, field

from bench.peer import rows_of
from structspec.config import Settings
from structspec.engine.engine import Engine, Request
from structspec.engine.proposers import STRATEGIES, DocumentIndex, DraftContext, make_proposer
from structspec.engine.proposers.suffix import History
from structspec.options import RequestOptions

DRAFTING = tuple(s for s in STRATEGIES if s != "none")


@dataclass
class Walk:
    """One strategy over every output."""

    strategy: str
    k: int
    passes: list[int] = field(default_factory=list)  # per document
    rows: int = 0
    tokens: int = 0
    misses: list[tuple[str, str, str]] = field(default_factory=list)  # (before, drafted, written)

    def line(self) -> str:
        total = sum(self.passes)
        return (f"{self.strategy}:{self.k}: passes most {max(self.passes)}, sum {total}, median "
                f"{statistics.median(self.passes):g}; rows {self.rows}; tokens per pass {self.tokens / total:.2f}")


def walk(engine: Engine, rows: list[dict], outputs: list[tuple[list[int], str, bool]], strategy: str, k: int,
         memory: History | None = None, misses: int = 0) -> Walk:
    """Replay `strategy` with drafts of up to `k` over each row's output ((tokens, text,
    succeeded)); with `memory`, it drafts from it and learns each succeeded output after its walk."""
    result = Walk(strategy, k)
    tt = engine.token_text
    for row, (tokens, text, succeeded) in zip(rows, outputs):
        grammar = engine.grammars.get_for(row["schema"], row["text"], False)
        matcher = grammar.matcher()
        ctx = DraftContext(matcher=matcher, output_text="", document=DocumentIndex(row["text"]), tokens=tt,
                           verbatim=grammar.verbatim, history=memory)
        proposer = make_proposer(strategy)
        pos = passes = 0
        while pos < len(tokens):
            ctx.output_tokens = tokens[:pos]
            ctx.output_text = tt.bytes_of(ctx.output_tokens).decode("utf-8", errors="replace")
            ctx.confidence = []
            draft = proposer.propose(ctx, k)[:k]
            draft = draft[:matcher.validate(draft)]
            accepted = 0
            while accepted < len(draft) and pos + accepted < len(tokens) and draft[accepted] == tokens[pos + accepted]:
                accepted += 1
            if accepted < len(draft) and len(result.misses) < misses:
                at = pos + accepted
                result.misses.append((tt.text_of(tokens[max(0, at - 6):at]), tt.text_of(draft[accepted:]),
                                      tt.text_of(tokens[at:at + len(draft) - accepted])))
            step = min(accepted + 1, len(tokens) - pos)
            if not matcher.consume(tokens[pos:pos + step]):
                raise RuntimeError(f"the grammar refused the output of {row.get('id', '?')}: {matcher.error()}")
            result.rows += 1 + len(draft)
            pos += step
            passes += 1
        result.passes.append(passes)
        result.tokens += len(tokens)
        if memory is not None and succeeded:
            memory.learn(tokens, text)
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.drafts", description=__doc__.split("\n\n")[0])
    p.add_argument("--dataset", default="receipts", help="'receipts' (bench/receipts.py) or a JSONL path")
    p.add_argument("--n", type=int, default=32)
    p.add_argument("--max-chars", type=int, default=4500)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--strategies", default="composite:8,composite:16,ngram:16",
                   help=f"STRATEGY:K, comma-separated ({', '.join(DRAFTING)})")
    p.add_argument("--memory", action="store_true", help="draft from a memory of the earlier outputs, learnt in order")
    p.add_argument("--misses", type=int, default=0, help="print the first N places each strategy's draft missed")
    args = p.parse_args(argv)
    arms = []
    for spec in (s for s in args.strategies.split(",") if s):
        name, _, k = spec.partition(":")
        if name not in DRAFTING or not k.isdigit() or int(k) < 1:
            p.error(f"--strategies: {spec!r} is not STRATEGY:K with a drafting strategy and K >= 1")
        arms.append((name, int(k)))
    settings = Settings.from_env()
    rows, _ = rows_of(args.dataset, args.n, args.max_chars)
    engine = Engine.from_settings(settings)
    options = RequestOptions(strategy="none", max_tokens=args.max_tokens)
    results = engine.run([Request(r["schema"], r["text"], options) for r in rows])
    outputs = [(list(r.tokens), r.text, r.status == "succeeded") for r in results]
    print(f"{len(rows)} documents ({args.dataset}), {sum(len(t) for t, _, _ in outputs)} output tokens from `none`"
          f"{', drafting from a memory of the earlier outputs' if args.memory else ''}")
    for name, k in arms:
        memory = History(settings.engine_suffix_schema_tokens) if args.memory else None
        result = walk(engine, rows, outputs, name, k, memory, args.misses)
        print(result.line())
        for before, drafted, written in result.misses:
            print(f"  after {before!r}: drafted {drafted!r}, written {written!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
