"""What per-value confidence costs: the same receipts decoded with STRUCTSPEC_ENGINE_CONFIDENCE
on and off, in one process, rounds interleaved (this machine is noisy).

    python -m structspec.bench.confidence [--docs 16] [--rounds 3] [--strategy none]

Prints the decode throughput of each setting and their ratio. The outputs must be identical
(confidence reads the logits; it never changes a token), which is checked.
"""

from __future__ import annotations

import argparse
import json
import time

from structspec.bench.receipts import RECEIPT_SCHEMA, receipts
from structspec.config import Settings
from structspec.engine.engine import Engine, Request
from structspec.engine.model import load_model
from structspec.options import RequestOptions

def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--docs", type=int, default=16)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--strategy", default="none")
    p.add_argument("--model", default="default")
    args = p.parse_args(argv)
    settings = Settings.from_env(model=args.model)
    loaded = load_model(settings.model, device=settings.device, dtype=settings.dtype, cache_dir=settings.cache_dir)
    schema = json.loads(RECEIPT_SCHEMA.read_text())
    docs = [r["text"] for r in receipts(args.docs, seed=7)]
    engines = {on: Engine(loaded, settings, engine_confidence=on) for on in (False, True)}
    opts = RequestOptions(strategy=args.strategy, draft_len=8, max_tokens=256)
    seconds, tokens, outputs = {False: 0.0, True: 0.0}, {False: 0, True: 0}, {}
    engines[False].run([Request(schema, docs[0], opts)])  # warm up (grammar compile, allocator)
    for _ in range(args.rounds):
        for on, engine in engines.items():
            start = time.perf_counter()
            results = engine.run([Request(schema, d, opts) for d in docs])
            seconds[on] += time.perf_counter() - start
            tokens[on] += sum(len(r.tokens) for r in results)
            outputs.setdefault(on, [r.tokens for r in results])
    assert outputs[False] == outputs[True], "confidence changed an output"
    rate = {on: tokens[on] / seconds[on] for on in (False, True)}
    print(f"{args.docs} receipts x {args.rounds} rounds, strategy {args.strategy}, batch up to "
          f"{settings.engine_max_seqs}: confidence off {rate[False]:.1f} tokens/s, on {rate[True]:.1f} tokens/s; "
          f"on/off = {rate[True] / rate[False]:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
