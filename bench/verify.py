"""Micro-benchmark of the verification kernels: Triton vs the torch reference.

    python -m bench.verify [--device cpu|cuda] [--quick] [--dtype bf16|fp16|fp32]

Sweeps batch size B, draft length n and vocabulary size V and prints a
Markdown table.  Drafts copy the masked argmax, so greedy verification
accepts everything and reads every row (the worst case).  On CUDA it also
prints the memory-bandwidth bound: the bytes of logits read once divided by
the device-to-device copy bandwidth measured on a large tensor.  On a CPU only
the torch reference is timed: Triton runs there only in its interpreter,
whose speed says nothing about the kernels.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from structspec.kernels.greedy import masked_argmax_torch, verify_greedy_torch, verify_greedy_triton
from structspec.kernels.sampling import verify_sampling_torch, verify_sampling_triton

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def _timer(device: torch.device, fn: Callable[[], object], warmup: int, iters: int) -> float:
    """Median time of ``fn`` in milliseconds: on CUDA between events recorded on the stream
    around each call (the device's time, launches included, without a host round trip per
    call); on a CPU wall time."""
    for _ in range(warmup):
        fn()
    if device.type == "cuda":
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
        torch.cuda.synchronize(device)
        for start, end in zip(starts, ends):
            start.record()
            fn()
            end.record()
        torch.cuda.synchronize(device)
        return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends))
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def copy_bandwidth(device: torch.device, nbytes: int = 1 << 30) -> float:
    """Device-to-device copy bandwidth in bytes/s (counts the read and the write)."""
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    ms = _timer(device, lambda: dst.copy_(src), warmup=3, iters=10)
    return 2 * nbytes / (ms / 1e3)


def make_inputs(batch: int, num_draft: int, vocab: int, dtype: torch.dtype, device: torch.device, seed: int = 0):
    """Random inputs for B sequences with n drafts each; drafts equal the masked argmax."""
    gen = torch.Generator(device=device).manual_seed(seed)
    num_rows = batch * (num_draft + 1)
    logits = torch.randn(num_rows, vocab, generator=gen, device=device).to(dtype)
    words = (vocab + 31) // 32
    bitmask = torch.randint(-(2**31), 2**31 - 1, (num_rows, words), generator=gen, device=device, dtype=torch.int32)
    cu = torch.arange(0, batch * num_draft + 1, num_draft, device=device, dtype=torch.int32)
    target = masked_argmax_torch(logits, bitmask).view(batch, num_draft + 1)
    draft_tokens = target[:, :num_draft].reshape(-1).clamp(min=0)
    temperature = torch.ones(batch, device=device)
    accept_uniform = 1.0 - torch.rand(batch * num_draft, generator=gen, device=device)
    sample_noise = torch.empty(batch, vocab, device=device).exponential_(generator=gen)  # a row per sequence
    greedy_args = (logits, bitmask, draft_tokens, cu)
    sampling_args = greedy_args + (temperature, accept_uniform, sample_noise)
    return greedy_args, sampling_args


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.verify",
                                     description="Benchmark the structspec verification kernels.")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--quick", action="store_true", help="a small sweep with few iterations")
    parser.add_argument(
        "--dtype", choices=sorted(DTYPES), default=None, help="logits dtype (default: bf16 on CUDA, fp32 on CPU)"
    )
    parser.add_argument(
        "--threads", type=int, default=None, help="torch CPU threads (default: torch's; 1 with --quick on CPU)"
    )
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda requested but CUDA is not available")
    dtype = DTYPES[args.dtype or ("bf16" if device.type == "cuda" else "fp32")]
    on_gpu = device.type == "cuda"

    if args.quick:
        batches, drafts, vocabs = (1, 8), (1, 4), (49152,)
        warmup, iters = 1, 3
    else:
        batches, drafts, vocabs = (1, 8, 64), (1, 4, 16), (49152, 128256, 151936)
        warmup, iters = 3, 20 if on_gpu else 5

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    elif args.quick and not on_gpu:
        # One thread keeps the quick run short and steady on a shared machine.
        torch.set_num_threads(1)
    name = torch.cuda.get_device_name(device) if on_gpu else f"CPU, {torch.get_num_threads()} torch thread(s)"
    print(f"# structspec verification kernels on {name} ({str(dtype).removeprefix('torch.')} logits)\n")
    bandwidth = copy_bandwidth(device) if on_gpu else None
    if bandwidth is not None:
        print(f"Measured copy bandwidth: {bandwidth / 1e9:.0f} GB/s (1 GiB device-to-device copy)\n")
    else:
        print(
            "No GPU: timing the torch reference only. Triton kernels run on a CPU only in the "
            "Triton interpreter, so timing them there would be meaningless.\n"
        )

    header = ["kernel", "B", "n", "V", "torch ms"]
    if on_gpu:
        header += ["triton ms", "speedup", "bound ms", "triton % of bound"]
    print("| " + " | ".join(header) + " |")
    print("|" + "|".join("---:" if h not in ("kernel",) else "---" for h in header) + "|")

    for vocab in vocabs:
        for batch in batches:
            for num_draft in drafts:
                greedy_args, sampling_args = make_inputs(batch, num_draft, vocab, dtype, device)
                cases = [
                    ("greedy", verify_greedy_torch, verify_greedy_triton, greedy_args),
                    ("sampling", verify_sampling_torch, verify_sampling_triton, sampling_args),
                ]
                logits = greedy_args[0]
                bound_ms = (logits.numel() * logits.element_size()) / bandwidth * 1e3 if bandwidth else None
                for kernel, torch_fn, triton_fn, fn_args in cases:
                    torch_ms = _timer(device, lambda: torch_fn(*fn_args), warmup, iters)
                    row = [kernel, str(batch), str(num_draft), str(vocab), f"{torch_ms:.3f}"]
                    if on_gpu:
                        triton_ms = _timer(device, lambda: triton_fn(*fn_args), warmup, iters)
                        row += [
                            f"{triton_ms:.3f}",
                            f"{torch_ms / triton_ms:.1f}x",
                            f"{bound_ms:.3f}",
                            f"{100 * bound_ms / triton_ms:.0f}%",
                        ]
                    print("| " + " | ".join(row) + " |", flush=True)
                del greedy_args, sampling_args, cases, fn_args, logits

    if on_gpu:
        print(
            "\nTimes are medians over CUDA events around each call; a call's argument validation "
            "and its one device-to-host sync are inside them. The bound is the logits read once; "
            "sampling also reads its sequence's fp32 noise row where it draws."
        )


if __name__ == "__main__":
    main()
