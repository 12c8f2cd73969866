"""Micro-benchmark of the linear layers on a CPU: oneDNN's prepacked GEMM against
kernels/cpu_linear.c, at the default model's shapes, in bf16 or fp32.

    python -m structspec.bench.linear [--rows 1,4,16,32,64,128,512] [--layers 30] [--dtype float32]

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
    from kernels.cpu_linear import load
    from structspec.bench.bound import DTYPE_UNITS, dtype_peak, memory_gbps, peak_gflops
    from structspec.engine.packed import PACK_ROWS

    p = argparse.ArgumentParser(prog="python -m structspec.bench.linear", description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", default="1,4,16,32,64,128,512", help="row counts (comma-separated)")
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    args = p.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    native = load()
    if dtype not in native.dtypes:
        raise SystemExit(f"the native linear kernel has no {args.dtype} on this CPU (bf16 needs AVX512-BF16)")
    gen = torch.Generator().manual_seed(0)
    plain = [{k: (torch.randn(n, i, generator=gen) * 0.05).to(dtype) for k, (i, n) in SHAPES.items()}
             for _ in range(args.layers)]
    head = (torch.randn(VOCAB, 576, generator=gen) * 0.05).to(dtype)
    weights = sum(w.numel() for layer in plain for w in layer.values()) + head.numel()
    nbytes = weights * head.element_size()
    onednn = [{k: torch.ops.mkldnn._reorder_linear_weight(w, PACK_ROWS) for k, w in layer.items()} for layer in plain]
    ours = [{k: native.pack(w) for k, w in layer.items()} for layer in plain]
    head_onednn, head_ours = torch.ops.mkldnn._reorder_linear_weight(head, PACK_ROWS), native.pack(head)
    del plain, head
    read_ms = nbytes / (memory_gbps() * 1e9) * 1000
    peak = dtype_peak(peak_gflops(names=DTYPE_UNITS[dtype]), dtype)  # the chip's, for this dtype (bench/bound.py)
    print(f"{nbytes / 1e6:.0f} MB of {args.dtype} weights, read once in {read_ms:.2f} ms; the chip's {args.dtype} "
          f"peak {peak} GFLOP/s; {torch.get_num_threads()} threads")
    print("| rows | oneDNN (ms) | native (ms) | oneDNN / native | native / weight read | native GFLOP/s (of the peak) |")
    print("|---|---|---|---|---|---|")
    for m in (int(x) for x in args.rows.split(",")):
        xs = {k: torch.randn(m, i, generator=gen).to(dtype) for k, (i, _) in SHAPES.items()}

        def run_onednn():
            for layer in onednn:
                for k in SHAPES:
                    torch.ops.mkldnn._linear_pointwise(xs[k], layer[k], None, "none", [], "")
            torch.ops.mkldnn._linear_pointwise(xs["qkv"], head_onednn, None, "none", [], "")

        def run_native():
            for layer in ours:
                for k in SHAPES:
                    native.linear(xs[k], layer[k])
            native.linear(xs["qkv"], head_ours)

        a, b = best_ms(run_onednn), best_ms(run_native)
        a, b = min(a, best_ms(run_onednn)), min(b, best_ms(run_native))
        gflops = 2 * weights * m / (b / 1000) / 1e9
        share = f" ({gflops / peak:.0%})" if peak else ""
        print(f"| {m} | {a:.2f} | {b:.2f} | {a / b:.2f}x | {b / read_ms:.2f}x | {gflops:.0f}{share} |")


if __name__ == "__main__":
    main()
