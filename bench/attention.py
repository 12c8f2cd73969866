"""Micro-benchmark of the native CPU attention (kernels/cpu_attention.c) at the default model's
shapes: decode, verification and prefill steps of a batch.

    python -m bench.attention [--shapes 16x1@512,16x4@512,16x1@1024,2x512@512]
                                         [--against OLD.c] [--layers 30] [--dtype float32]

A shape SxR@P is S sequences of R new rows each over P tokens of past: 16x1 a decode step of 16
sequences, 16x4 a verification step with 3 drafts each, 2x512 two 512-row prefill chunks.
SmolLM2-135M's heads (9 query heads over 3 kv heads of 64), bf16 queries and KV (fp32 with
`--dtype float32`, as an fp32 model's engine attends), `--layers`
layers of distinct KV buffers, so a step streams its keys and values from memory as the engine's
passes do. Prints the best of several steps, the KV bytes a step reads, and the time to read
them once at the bandwidth of a 1 GiB sum measured in the same run. `--against` builds another
version of the source (an older commit's: `git show REV:kernels/cpu_attention.c > old.c`) and
times it interleaved with this one, and says whether the two wrote the same outputs bit for bit
(the last column: "same", or the largest difference). A benchmark: run it alone.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from bench.linear import best_ms

HEADS, KV_HEADS, DIM = 9, 3, 64


def parse_shape(text: str) -> tuple[int, int, int]:
    try:
        seqs_rows, past = text.split("@")
        seqs, rows = seqs_rows.split("x")
        shape = int(seqs), int(rows), int(past)
    except ValueError:
        raise SystemExit(f"--shapes: {text!r} is not SEQSxROWS@PAST (e.g. 16x1@512)") from None
    if shape[0] < 1 or shape[1] < 1 or shape[2] < 0:
        raise SystemExit(f"--shapes: {text!r} needs at least one sequence and one row")
    return shape


def step(seqs: int, rows: int, past: int, layers: int, gen: torch.Generator, dtype: torch.dtype = torch.bfloat16):
    """(q, k, v, out, table, buffers) of one step: every sequence's KV per layer, past filled."""
    cap = past + rows
    buffers, table = [], torch.zeros(2 * layers + 4, seqs, dtype=torch.int64)
    for layer in range(layers):
        for j in range(seqs):
            k = torch.randn(KV_HEADS, cap, DIM, generator=gen).to(dtype)
            v = torch.randn(KV_HEADS, cap, DIM, generator=gen).to(dtype)
            buffers += [k, v]
            table[layer, j], table[layers + layer, j] = k.data_ptr(), v.data_ptr()
    for j in range(seqs):
        table[2 * layers:, j] = torch.tensor([j * rows, rows, past, cap])
    t = seqs * rows
    q = torch.randn(t, HEADS, DIM, generator=gen).to(dtype)
    k = torch.randn(t, KV_HEADS, DIM, generator=gen).to(dtype)
    v = torch.randn(t, KV_HEADS, DIM, generator=gen).to(dtype)
    return q, k, v, torch.empty(t, HEADS, DIM), table, buffers


def main(argv: list[str] | None = None) -> None:
    from structspec.kernels import cpu_attention, native
    from bench.bound import memory_gbps

    p = argparse.ArgumentParser(prog="python -m bench.attention", description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default="16x1@512,16x4@512,16x1@1024,2x512@512",
                   help="steps as SEQSxROWS@PAST, comma-separated")
    p.add_argument("--against", type=Path, help="another version of kernels/cpu_attention.c to time beside this one")
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16",
                   help="queries and KV (float32: an fp32 model's attention)")
    args = p.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    shapes = [parse_shape(s) for s in args.shapes.split(",")]
    libs = {"this": cpu_attention.load(DIM, DIM)}
    if args.against is not None:
        if not args.against.is_file():
            raise SystemExit(f"--against: no file {args.against}")
        path = native.build(args.against, cpu_attention.FLAGS + (f"-DHEAD_DIM={DIM}", f"-DVALUE_DIM={DIM}"))
        libs = {"against": cpu_attention.NativeAttention(path, DIM, DIM), **libs}
    gbps = memory_gbps()
    print(f"{torch.get_num_threads()} threads; memory {gbps:.1f} GB/s (1 GiB sum); "
          f"P.V with bf16 probabilities: {', '.join(f'{n} {lib.p_bf16}' for n, lib in libs.items())}")
    names = list(libs)
    print("| step | KV read | " + " | ".join(f"{n} (ms)" for n in names) + " | KV at the bandwidth (ms) |"
          + (" against / this | outputs |" if len(names) > 1 else ""))
    print("|---|---|" + "---|" * len(names) + "---|" + ("---|---|" if len(names) > 1 else ""))
    gen = torch.Generator().manual_seed(0)
    for seqs, rows, past in shapes:
        q, k, v, out, table, buffers = step(seqs, rows, past, args.layers, gen, dtype)
        nbytes = seqs * (past + rows) * args.layers * KV_HEADS * DIM * 2 * dtype.itemsize

        def run(lib, into=out):
            for layer in range(args.layers):
                lib.attend(q, k, v, into, table, args.layers, layer, DIM ** -0.5, kv_dtype=dtype,
                           check=layer == 0)

        times = {n: float("inf") for n in names}
        for _ in range(3):  # interleaved, best of each
            for n in names:
                times[n] = min(times[n], best_ms(lambda: run(libs[n]), repeats=5))
        cells = " | ".join(f"{times[n]:.2f}" for n in names)
        ratio = ""
        if len(names) > 1:
            outs = {n: torch.full_like(out, float("nan")) for n in names}
            for n in names:
                run(libs[n], outs[n])
            diff = (outs["against"] - outs["this"]).abs().max().item()
            same = "same" if torch.equal(outs["against"], outs["this"]) else f"differ (max {diff:.3g})"
            ratio = f" {times['against'] / times['this']:.2f}x | {same} |"
        print(f"| {seqs}x{rows}@{past} | {nbytes / 1e6:.0f} MB | {cells} | {nbytes / (gbps * 1e9) * 1000:.2f} |{ratio}")
        del buffers


if __name__ == "__main__":
    main()
