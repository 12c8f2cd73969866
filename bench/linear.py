"""Micro-benchmark of the linear layers on a CPU: oneDNN's prepacked GEMM against
kernels/cpu_linear.c, at the default model's shapes, in bf16 or fp32.

    python -m bench.linear [--rows 1,4,16,32,64,128,512] [--layers 30] [--dtype float32]
                                      [--against OLD.c]

SmolLM2-135M's four GEMMs a layer (q/k/v fused 576 -> 960, o 576 -> 576, gate/up fused 576 ->
3,072, down 1,536 -> 576) for `--layers` layers of distinct random weights, then the 49,152-row
lm_head: 269 MB of bf16 weights (538 MB in fp32), more than any cache here, so each pass streams them from
memory as the engine's passes do. Prints, per row count, the best of several passes each way
(interleaved), and the time to read the weights once at the bandwidth of a 1 GiB sum measured in
the same run. A benchmark: run it alone.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

SHAPES = {"qkv": (576, 960), "o": (576, 576), "gate_up": (576, 3072), "down": (1536, 576)}  # (in, out)
VOCAB = 49152


def best_ms(fn, repeats: int = 7) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times) * 1000


def main(argv: list[str] | None = None) -> None:
    from structspec.kernels import cpu_linear, native as native_build
    from bench.bound import DTYPE_UNITS, dtype_peak, memory_gbps, peak_gflops
    from structspec.engine.packed import PACK_ROWS

    p = argparse.ArgumentParser(prog="python -m bench.linear", description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", default="1,4,16,32,64,128,512", help="row counts (comma-separated)")
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    p.add_argument("--against", type=Path, help="another version of kernels/cpu_linear.c to time beside this one")
    args = p.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    libs = {"native": cpu_linear.load()}
    if args.against is not None:
        if not args.against.is_file():
            raise SystemExit(f"--against: no file {args.against}")
        libs = {"against": cpu_linear.NativeLinear(native_build.build(args.against, cpu_linear.FLAGS)), **libs}
    for name, lib in libs.items():
        if dtype not in lib.dtypes:
            raise SystemExit(f"the {name} linear kernel has no {args.dtype} on this CPU (bf16 needs AVX512-BF16)")
    gen = torch.Generator().manual_seed(0)
    plain = [{k: (torch.randn(n, i, generator=gen) * 0.05).to(dtype) for k, (i, n) in SHAPES.items()}
             for _ in range(args.layers)]
    head = (torch.randn(VOCAB, 576, generator=gen) * 0.05).to(dtype)
    weights = sum(w.numel() for layer in plain for w in layer.values()) + head.numel()
    nbytes = weights * head.element_size()
    onednn = [{k: torch.ops.mkldnn._reorder_linear_weight(w, PACK_ROWS) for k, w in layer.items()} for layer in plain]
    ours = {n: ([{k: lib.pack(w) for k, w in layer.items()} for layer in plain], lib.pack(head))
            for n, lib in libs.items()}
    head_onednn = torch.ops.mkldnn._reorder_linear_weight(head, PACK_ROWS)
    del plain, head
    read_ms = nbytes / (memory_gbps() * 1e9) * 1000
    peak = dtype_peak(peak_gflops(names=DTYPE_UNITS[dtype]), dtype)  # the chip's, for this dtype (bench/bound.py)
    print(f"{nbytes / 1e6:.0f} MB of {args.dtype} weights, read once in {read_ms:.2f} ms; the chip's {args.dtype} "
          f"peak {peak} GFLOP/s; {torch.get_num_threads()} threads")
    against = len(libs) > 1
    print("| rows | oneDNN (ms) | native (ms) | oneDNN / native | native / weight read | native GFLOP/s (of the peak) |"
          + (" against (ms) | against / native | outputs |" if against else ""))
    print("|---|---|---|---|---|---|" + ("---|---|---|" if against else ""))
    for m in (int(x) for x in args.rows.split(",")):
        xs = {k: torch.randn(m, i, generator=gen).to(dtype) for k, (i, _) in SHAPES.items()}

        def run_onednn():
            for layer in onednn:
                for k in SHAPES:
                    torch.ops.mkldnn._linear_pointwise(xs[k], layer[k], None, "none", [], "")
            torch.ops.mkldnn._linear_pointwise(xs["qkv"], head_onednn, None, "none", [], "")

        def run_native(name, keep=None):
            lib, (layers, head_packed) = libs[name], ours[name]
            for layer in layers:
                for k in SHAPES:
                    y = lib.linear(xs[k], layer[k])
                    if keep is not None:
                        keep.append(y)
            y = lib.linear(xs["qkv"], head_packed)
            if keep is not None:
                keep.append(y)

        times = {"oneDNN": float("inf")} | {n: float("inf") for n in libs}
        for _ in range(2):  # interleaved, best of each
            times["oneDNN"] = min(times["oneDNN"], best_ms(run_onednn))
            for n in libs:
                times[n] = min(times[n], best_ms(lambda: run_native(n)))
        a, b = times["oneDNN"], times["native"]
        gflops = 2 * weights * m / (b / 1000) / 1e9
        share = f" ({gflops / peak:.0%})" if peak else ""
        extra = ""
        if against:
            outs = {n: [] for n in libs}
            for n in libs:
                run_native(n, outs[n])
            same = all(torch.equal(x, y) for x, y in zip(outs["against"], outs["native"]))
            extra = f" {times['against']:.2f} | {times['against'] / b:.2f}x | {'same' if same else 'differ'} |"
        print(f"| {m} | {a:.2f} | {b:.2f} | {a / b:.2f}x | {b / read_ms:.2f}x | {gflops:.0f}{share} |{extra}")


if __name__ == "__main__":
    main()
