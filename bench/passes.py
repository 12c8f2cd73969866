"""One forward pass by shape: how the cost of a pass grows with sequences and rows.

Used by `bench batch` (part e) and the GPU check (`bench/gpu.py`); it needs only the engine,
so it runs where the service's other dependencies are not installed. On its own:

    python -m bench.passes [--contexts 1100] [--shapes 16x1,16x2,16x3] [--repeats 5]

times the default model's engine (its default dtype and forward) at each context and shape
(SEQUENCESxROWS: that many sequences with that many new rows each, full logits for every row, so
a draft row costs here at most what it costs in the engine, whose grammar prunes some of them).
A benchmark: run it alone.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from structspec.engine.engine import Engine
from structspec.engine.kv_cache import Segment, Slot
from structspec.engine.runner import StepInputs

SHAPES = ((1, 1), (1, 16), (16, 1), (16, 2), (1, 32), (32, 1))  # (sequences, rows each)


def context_slots(engine: Engine, count: int, context: int, room: int) -> list[Slot]:
    """`count` of the runner's slots, each holding the same `context` tokens (random ids, one
    prefill, then copies) with `room` tokens free after them."""
    runner, dev = engine.runner, engine.runner.device
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(1, engine.loaded.vocab_size - 1, (context,), generator=gen)
    first = Slot(runner.layout, context + room, dev)
    runner.forward(StepInputs(ids.to(dev), torch.arange(context, device=dev), [Segment(first, 0, context, 0)],
                              torch.tensor([context - 1], device=dev)))
    slots = [first]
    for _ in range(count - 1):
        slot = Slot(runner.layout, context + room, dev)
        for dst, src in zip(slot.keys + slot.values, first.keys + first.values):
            dst[:, :context].copy_(src[:, :context])
        slots.append(slot)
    return slots


def step_over(slots: list[Slot], sequences: int, rows: int, context: int, device) -> StepInputs:
    """A pass of `rows` new rows for each of the first `sequences` slots after `context` tokens
    (their lengths reset to `context`, so it can run again), logits for every row."""
    segs, pos = [], []
    for b in range(sequences):
        slots[b].length = context
        segs.append(Segment(slots[b], b * rows, rows, context))
        pos += range(context, context + rows)
    return StepInputs(torch.full((sequences * rows,), 5, device=device), torch.tensor(pos, device=device), segs,
                      torch.arange(sequences * rows, device=device))


def pass_shapes(engine: Engine, contexts: tuple[int, ...], repeats: int = 3,
                shapes: tuple[tuple[int, int], ...] = SHAPES) -> list[dict]:
    """Milliseconds of one forward pass by shape: the same rows as one sequence's draft or as one
    row each of many sequences, every sequence `context` tokens deep (random tokens; the
    runner's own slots and segments, outside any request). The pass-cost curve (cost.py) is
    keyed by rows alone; this shows what the number of sequences adds."""
    runner, out = engine.runner, []
    if not runner.batched:
        return out
    dev = runner.device
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda *_: None)
    longest = max(rows for _, rows in shapes)
    for ctx in contexts:
        slots = context_slots(engine, max(n for n, _ in shapes), ctx, longest)
        times: dict = {s: [] for s in shapes}
        for i in range(repeats + 1):  # the first round warms up (CUDA: kernels, allocator)
            for n, rows in (shapes if i % 2 == 0 else shapes[::-1]):
                step = step_over(slots, n, rows, ctx, dev)
                sync(dev)
                t = time.perf_counter()
                runner.forward(step)
                sync(dev)
                if i:
                    times[(n, rows)].append(time.perf_counter() - t)
        out += [{"context": ctx, "sequences": n, "rows_each": rows, "rows": n * rows,
                 "ms": round(statistics.median(times[(n, rows)]) * 1000, 3)} for n, rows in shapes]
        del slots
    return out


def parse_shapes(text: str) -> tuple[tuple[int, int], ...]:
    """'16x1,16x2' -> ((16, 1), (16, 2)); SystemExit naming a shape that is not SEQUENCESxROWS."""
    shapes = []
    for part in text.split(","):
        try:
            n, rows = (int(x) for x in part.strip().split("x"))
        except ValueError:
            raise SystemExit(f"--shapes: {part.strip()!r} is not SEQUENCESxROWS (e.g. 16x2)") from None
        if n < 1 or rows < 1:
            raise SystemExit(f"--shapes: {part.strip()!r} needs at least one sequence and one row")
        shapes.append((n, rows))
    return tuple(shapes)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.passes", description=__doc__.split("\n\n")[0])
    p.add_argument("--contexts", default="512,1100", help="tokens already cached in each sequence (comma-separated)")
    p.add_argument("--shapes", default="16x1,16x2,16x3,16x4,16x6,1x1,1x4,1x8", help="SEQUENCESxROWS, comma-separated")
    p.add_argument("--repeats", type=int, default=5, help="timed rounds (the median is reported)")
    p.add_argument("--model", default="default")
    args = p.parse_args(argv)
    shapes = parse_shapes(args.shapes)
    try:
        contexts = tuple(int(c) for c in args.contexts.split(","))
    except ValueError:
        raise SystemExit(f"--contexts: {args.contexts!r} is not a comma-separated list of token counts") from None
    from structspec.engine.model import load_model

    engine = Engine(load_model(args.model, device="cpu"))
    rows = pass_shapes(engine, contexts, args.repeats, shapes)
    print(f"{engine.loaded.dtype_note}; {torch.get_num_threads()} threads; median of {args.repeats}")
    print("| context | sequences x rows | ms | x the same sequences' one-row pass |")
    print("|---|---|---|---|")
    one = {(r["context"], r["sequences"]): r["ms"] for r in rows if r["rows_each"] == 1}
    for r in rows:
        base = one.get((r["context"], r["sequences"]))
        ratio = f"{r['ms'] / base:.2f}x" if base else ""
        print(f"| {r['context']} | {r['sequences']} x {r['rows_each']} | {r['ms']} | {ratio} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
