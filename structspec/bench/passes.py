"""One forward pass by shape: how the cost of a pass grows with sequences and rows.

Used by `bench batch` (part e) and the GPU check (`bench/gpu.py`); it needs only the engine,
so it runs where the service's other dependencies are not installed.
"""

from __future__ import annotations

import statistics
import time

import torch

from structspec.engine.engine import Engine
from structspec.engine.kv_cache import Segment, Slot
from structspec.engine.runner import StepInputs

SHAPES = ((1, 1), (1, 16), (16, 1), (16, 2), (1, 32), (32, 1))  # (sequences, rows each)


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
    on = lambda t: t.to(dev)  # noqa: E731
    gen = torch.Generator().manual_seed(0)
    longest = max(rows for _, rows in shapes)
    for ctx in contexts:
        ids = torch.randint(1, engine.loaded.vocab_size - 1, (ctx,), generator=gen)
        first = Slot(runner.layout, ctx + longest, dev)
        runner.forward(StepInputs(on(ids), on(torch.arange(ctx)), [Segment(first, 0, ctx, 0)],
                                  on(torch.tensor([ctx - 1]))))
        slots = [first]
        for _ in range(max(n for n, _ in shapes) - 1):
            slot = Slot(runner.layout, ctx + longest, dev)
            for dst, src in zip(slot.keys + slot.values, first.keys + first.values):
                dst[:, :ctx].copy_(src[:, :ctx])
            slots.append(slot)
        times: dict = {s: [] for s in shapes}
        for i in range(repeats + 1):  # the first round warms up (CUDA: kernels, allocator)
            for n, rows in (shapes if i % 2 == 0 else shapes[::-1]):
                segs, pos = [], []
                for b in range(n):
                    slots[b].length = ctx
                    segs.append(Segment(slots[b], b * rows, rows, ctx))
                    pos += range(ctx, ctx + rows)
                step = StepInputs(on(torch.full((n * rows,), 5)), on(torch.tensor(pos)), segs,
                                  on(torch.arange(n * rows)))
                sync(dev)
                t = time.perf_counter()
                runner.forward(step)
                sync(dev)
                if i:
                    times[(n, rows)].append(time.perf_counter() - t)
        out += [{"context": ctx, "sequences": n, "rows_each": rows, "rows": n * rows,
                 "ms": round(statistics.median(times[(n, rows)]) * 1000, 3)} for n, rows in shapes]
        del slots, first
    return out
