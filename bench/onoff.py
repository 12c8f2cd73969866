"""What an engine setting that must not change an output costs or saves: the same receipts
decoded with a boolean engine setting off and on, in one process, rounds interleaved (this
machine is noisy).

    python -m bench.onoff [--setting engine_confidence] [--docs 16] [--rounds 3]
                                     [--strategy none] [--max-tokens 256]

Settings measured so far: `engine_confidence` (per-value confidence reads the logits; the
default) and `engine_pruned_logits` (the pruned lm_head computes the allowed logits' same bits).
Prints each side's decode throughput and their ratio. The outputs must be identical, which is
checked (an AssertionError names the setting otherwise).
"""

from __future__ import annotations

import argparse
import json
import time

from bench.receipts import RECEIPT_SCHEMA, receipts
from structspec.config import Settings
from structspec.engine.engine import Engine, Request
from structspec.engine.model import load_model
from structspec.options import RequestOptions

# the engine settings that leave every output as it is (so an A/B of throughput is all there is)
SAME_OUTPUT = ("engine_confidence", "engine_pruned_logits")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--setting", default="engine_confidence", choices=SAME_OUTPUT)
    p.add_argument("--docs", type=int, default=16)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--strategy", default="none")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--model", default="default")
    args = p.parse_args(argv)
    if args.docs < 1 or args.rounds < 1 or args.max_tokens < 1:
        raise SystemExit("--docs, --rounds and --max-tokens must be at least 1")
    settings = Settings.from_env(model=args.model)
    loaded = load_model(settings.model, device=settings.device, dtype=settings.dtype, cache_dir=settings.cache_dir)
    schema = json.loads(RECEIPT_SCHEMA.read_text())
    docs = [r["text"] for r in receipts(args.docs, seed=7)]
    engines = {on: Engine(loaded, settings, **{args.setting: on}) for on in (False, True)}
    opts = RequestOptions(strategy=args.strategy, draft_len=8, max_tokens=args.max_tokens)
    seconds, tokens, outputs = {False: 0.0, True: 0.0}, {False: 0, True: 0}, {}
    for engine in engines.values():  # warm up (grammar compile, allocator, kernel builds)
        engine.run([Request(schema, docs[0], opts)])
    for _ in range(args.rounds):
        for on, engine in engines.items():
            engine.clear_prefix_cache()  # each run from a cold prefix cache
            start = time.perf_counter()
            results = engine.run([Request(schema, d, opts) for d in docs])
            seconds[on] += time.perf_counter() - start
            tokens[on] += sum(len(r.tokens) for r in results)
            outputs.setdefault(on, [r.tokens for r in results])
    assert outputs[False] == outputs[True], f"{args.setting} changed an output"
    rate = {on: tokens[on] / seconds[on] for on in (False, True)}
    print(f"{args.docs} receipts x {args.rounds} rounds, strategy {args.strategy}, max_tokens {args.max_tokens}, "
          f"batch up to {settings.engine_max_seqs}, linear {engines[True].linear}: {args.setting} off "
          f"{rate[False]:.1f} tokens/s, on {rate[True]:.1f} tokens/s; on/off = {rate[True] / rate[False]:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
