"""The machine's physical limits, measured, and the engine's passes as multiples of them.

`python -m bench.bound` measures in one run:

- the chip: torch's CPU capability and whether it reports AMX / AVX512-BF16 (the units a bf16
  GEMM needs to beat fp32);
- GEMM rate, fp32 and bf16, at a prefill shape (512 x 576 by 576 x 1536, the default model's
  MLP) and a decode shape (16 rows);
- memory bandwidth: the best of several sums over a 1 GiB fp32 tensor (bytes read / time);
- the chip's arithmetic peak (kernels/cpu_peak.c: independent chains of fp32 FMAs, of bf16
  vdpbf16ps, and of AMX tdpbf16ps where the CPU has each, on torch's threads, nothing read from
  memory): no GEMM or pass can be faster, so the GEMM rate and the prefill chunk are also given
  as a share of it (`peak_gflops`; bf16's is the faster of its two units);
- per dtype, with the default model: the bytes of its weights and the time to read them once
  at that bandwidth (a decode step cannot be faster: every weight is read each pass); the
  engine's decode pass of 16 sequences x 1 row and of 1 x 1 at 512 tokens of context, as
  multiples of that bound and of the larger of it and the 16 rows' GEMMs at the measured
  decode-shaped GEMM rate (on 2 cores the compute floor is the higher one), and of the time to
  read the weights and the 16 sequences' KV cache once (the pass reads both); each without and
  with the linear layers prepacked (engine/packed.py), and prepacked through the lean forward
  (engine/lean.py), then that with the native attention (kernels/cpu_attention.c), then that
  with the layer's elementwise steps fused in C (kernels/cpu_layer.c), then that with the bf16
  linear layers through kernels/cpu_linear.c where the engine picks it, then that with the loop
  over the layers in one C call (kernels/cpu_forward.c) where the engine picks it (the default);
  and a 512-token prefill chunk (logits of its last row only, as the
  engine computes them) as GFLOP/s against the measured GEMM rate of its dtype (the linear
  layers' 2 x weights x tokens, plus the lm_head for the one row; the embedding is a lookup, and
  attention is left out: a lower estimate of the work. Before 2026-11-27 the count was 2 x every
  parameter x tokens, which counted the 28M-entry embedding for every token and overstated the
  default model's prefill rate by 1.27x);
- with --profile, where the 16-sequence decode pass and the 512-token prefill chunk spend their
  time, by part and by torch operator (of the pass that loops in Python: its timers wrap the
  Python calls).

The machine's limits drift: on the AMX host the bf16 GEMM at the prefill shape ran at 2,178
GFLOP/s at the start of a run and at ~910 a few minutes later (docs/benchmarks.md). So each
model's passes are set against the GEMM rate and bandwidth measured just before and just after
them (`limits_before`, `limits_after`), the larger of each pair taken as the bound (`limits`): a
multiple of the run-start figures alone could be off by 2x either way.

A benchmark: run it alone (a test run beside it on 2 cores halves every figure).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch

from structspec.engine.model import cpu_has_bf16_matmul, resolve_dtype

PREFILL_SHAPE = (512, 576, 1536)  # (m, k, n)
DECODE_SHAPE = (16, 576, 1536)
BANDWIDTH_BYTES = 1 << 30
CONTEXT = 512


def best_seconds(fn, repeats: int, min_s: float = 0.0) -> float:
    """The fastest of `repeats` calls (after one warm-up); at least `min_s` of calls in all."""
    fn()
    times, spent = [], 0.0
    while len(times) < repeats or spent < min_s:
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
        spent += times[-1]
    return min(times)


def gemm_gflops(dtype: torch.dtype, shape: tuple[int, int, int], repeats: int = 20) -> float:
    m, k, n = shape
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(m, k, generator=gen).to(dtype)
    b = torch.randn(k, n, generator=gen).to(dtype)
    s = best_seconds(lambda: torch.mm(a, b), repeats, min_s=0.5)
    return 2 * m * k * n / s / 1e9


def memory_gbps(nbytes: int = BANDWIDTH_BYTES, repeats: int = 8) -> float:
    x = torch.ones(nbytes // 4, dtype=torch.float32)
    s = best_seconds(lambda: x.sum(), repeats)
    return nbytes / s / 1e9


PEAK_SOURCE = Path(__file__).with_name("cpu_peak.c")  # the harness's kernel: not shipped with the package
PEAK_KINDS = {"fp32 FMA": 0, "bf16 vdpbf16ps": 1, "bf16 AMX": 2}  # bench/cpu_peak.c's kinds
DTYPE_UNITS = {torch.float32: ("fp32 FMA",), torch.bfloat16: ("bf16 vdpbf16ps", "bf16 AMX")}  # which serve a dtype


def peak_gflops(threads: int = 0, seconds: float = 0.15, repeats: int = 3,
                names: tuple[str, ...] = tuple(PEAK_KINDS)) -> dict[str, float | None]:
    """The chip's arithmetic peak by instruction (`names` of PEAK_KINDS), GFLOP/s on `threads`
    threads (0: torch's), the best of `repeats` runs of ~`seconds` each; None for what this CPU or
    build lacks, or for every kind when no C compiler builds the kernel."""
    import ctypes

    from structspec.kernels import native

    source = PEAK_SOURCE

    def wrap(path: Path):
        lib = native.open_library(path, source, "structspec_peak_version", 1)
        lib.structspec_peak_gflops.restype = ctypes.c_double
        lib.structspec_peak_gflops.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int]
        return lib.structspec_peak_gflops

    try:
        run = native.load(source, (), None, wrap)
    except RuntimeError:
        return dict.fromkeys(names)
    threads = threads or torch.get_num_threads()
    out: dict[str, float | None] = {}
    for name in names:
        kind, probe = PEAK_KINDS[name], 1 << 16
        t = time.perf_counter()
        if run(kind, probe, threads) <= 0:
            out[name] = None
            continue
        steps = max(probe, int(probe * seconds / max(time.perf_counter() - t, 1e-6)))  # ~`seconds` a run
        out[name] = round(max(run(kind, steps, threads) for _ in range(repeats)), 1)
    return out


def dtype_peak(peaks: dict[str, float | None], dtype: torch.dtype) -> float | None:
    """The fastest unit's peak for `dtype` (bf16: the AMX tiles or vdpbf16ps; fp32: FMA)."""
    rates = [peaks[n] for n in DTYPE_UNITS[dtype] if peaks.get(n)]
    return max(rates) if rates else None


def limits(dtype: torch.dtype) -> dict:
    """The machine's limits now, for `dtype`: GEMM GFLOP/s at the prefill and decode shapes,
    memory GB/s, and the chip's peak for `dtype` (None without a C compiler)."""
    return {"gemm_prefill_gflops": round(gemm_gflops(dtype, PREFILL_SHAPE), 1),
            "gemm_decode_gflops": round(gemm_gflops(dtype, DECODE_SHAPE), 1),
            "memory_gbps": round(memory_gbps(), 2),
            "peak_gflops": dtype_peak(peak_gflops(names=DTYPE_UNITS[dtype]), dtype)}


def chip() -> dict:
    name = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"cpu": name, "torch": torch.__version__, "capability": torch.backends.cpu.get_cpu_capability(),
            "bf16_matrix_units": cpu_has_bf16_matmul(), "threads": torch.get_num_threads()}


def engine_passes(engine, repeats: int = 5) -> dict:
    """Milliseconds of the engine's own passes at CONTEXT tokens: decode 16 x 1 and 1 x 1 rows,
    and one sequence's 512-token prefill chunk with logits of its last row."""
    from bench.passes import pass_shapes

    shapes = {f"{n}x{r}": row["ms"] for row in pass_shapes(engine, (CONTEXT,), repeats, ((16, 1), (1, 1)))
              for n, r in [(row["sequences"], row["rows_each"])]}
    shapes["prefill_512"] = round(best_seconds(prefill_pass(engine), repeats) * 1000, 3)
    return shapes


def prefill_pass(engine):
    """A callable running one sequence's CONTEXT-token prefill chunk (logits of its last row),
    the same chunk each call."""
    from structspec.engine.kv_cache import Segment, Slot
    from structspec.engine.runner import StepInputs

    runner = engine.runner
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(1, engine.loaded.vocab_size - 1, (CONTEXT,), generator=gen)
    slot = Slot(runner.layout, CONTEXT, runner.device)

    def prefill():
        slot.length = 0
        runner.forward(StepInputs(ids, torch.arange(CONTEXT), [Segment(slot, 0, CONTEXT, 0)],
                                  torch.tensor([CONTEXT - 1])))
    return prefill


def profile_decode(engine, sequences: int = 16, top: int = 12, passes: int = 5) -> dict:
    """Where a decode pass of `sequences` x 1 row at CONTEXT tokens spends its time (profile_pass).
    Only the decode passes are measured, not the prefill that fills the context."""
    from bench.passes import context_slots, step_over

    runner = engine.runner
    step = step_over(context_slots(engine, sequences, CONTEXT, 1), sequences, 1, CONTEXT, runner.device)
    return {"sequences": sequences, "context": CONTEXT,
            **profile_pass(engine, lambda: runner.forward(step), top, passes)}


def profile_prefill(engine, top: int = 12, passes: int = 5) -> dict:
    """Where one sequence's CONTEXT-token prefill chunk spends its time (profile_pass)."""
    return {"tokens": CONTEXT, **profile_pass(engine, prefill_pass(engine), top, passes)}


def profile_pass(engine, run, top: int, passes: int) -> dict:
    """Where `run` (one forward pass) spends its time, two ways: wall time by part (the linear
    layers, the native attention's C call, the fused layer steps, the rest: Python and torch's
    other operators), by timers around those calls; and torch's profiler by operator (its own
    overhead inflates small operators, and it does not see the C calls)."""
    from torch.profiler import ProfilerActivity, profile

    from structspec.engine.packed import PackedLinear

    runner = engine.runner
    run()  # warm-up
    parts: dict[str, float] = {}
    lean = getattr(runner, "lean", None)
    timed = [(PackedLinear, "forward", "linear layers"), (torch.nn.Linear, "forward", "linear layers")]
    if runner.native is not None:
        timed.append((runner.native, "attend", "native attention"))
    if lean is not None and lean.ops is not None:
        timed += [(lean.ops, name, "fused layer steps") for name in ("add_rms_norm", "rotary_", "silu_mul")]
    saved = [(obj, name, getattr(obj, name)) for obj, name, _ in timed]  # classes: their functions

    def timer(fn, part):
        def timed_call(*args, **kwargs):
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                parts[part] = parts.get(part, 0.0) + time.perf_counter() - t
        return timed_call

    for obj, name, part in timed:
        setattr(obj, name, timer(getattr(obj, name), part))
    try:
        start = time.perf_counter()
        for _ in range(passes):
            run()
        total = time.perf_counter() - start
    finally:
        for obj, name, fn in saved:
            if isinstance(obj, type):
                setattr(obj, name, fn)
            else:  # the timer shadowed the class's method on the instance
                delattr(obj, name)
    parts["the rest"] = total - sum(parts.values())
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(passes):
            run()
    events = prof.key_averages()
    rows = sorted(events, key=lambda e: -e.self_cpu_time_total)[:top]
    return {"ms_per_pass": round(total / passes * 1000, 2),
            "ms_per_pass_by_part": {k: round(v / passes * 1000, 2) for k, v in parts.items()},
            "torch_profiler_ops": [{"op": e.key, "calls_per_pass": e.count // passes,
                                    "ms_per_pass": round(e.self_cpu_time_total / 1000 / passes, 2)} for e in rows]}


def model_figures(dtype: str, profiled: bool = False, packed: bool = True,
                  lean: bool = True, kernel_backend: str = "auto", fused: bool = True,
                  native_linear: bool = True, layer_loop: bool = True) -> dict:
    """The default model in `dtype`, its linear layers prepacked or not (engine/packed.py), through
    the lean forward (engine/lean.py) or its own, its attention as `kernel_backend` picks it
    ("torch": SDPA per sequence; "auto" on a CPU: the native kernel), the lean forward's
    elementwise steps fused in C where the engine picks that (`fused`; False: torch's), its
    linear layers through kernels/cpu_linear.c where the engine picks that (`native_linear`;
    False: oneDNN's packing), its layer loop in C where the engine picks that (`layer_loop`;
    False: in Python). Its passes are set against the limits measured just before and after them
    (the larger of each pair)."""
    from unittest import mock

    from structspec.engine import engine as engine_module
    from structspec.engine.model import load_model

    loaded = load_model("default", device="cpu", dtype=dtype)
    params = sum(p.numel() for p in loaded.model.parameters())
    nbytes = sum(p.numel() * p.element_size() for p in loaded.model.parameters())
    choose = engine_module.native_linear if native_linear else (lambda *args: None)
    with mock.patch.object(engine_module, "native_linear", choose):
        engine = engine_module.Engine(loaded, kernel_backend=kernel_backend, engine_packed_linear=packed,
                                      engine_lean_forward=lean)
    lean_forward = getattr(engine.runner, "lean", None)
    if lean_forward is not None and not fused:
        lean_forward.ops = None  # the same forward with torch's elementwise operators
    if lean_forward is not None and not layer_loop:
        lean_forward.layer_loop = None  # the same calls, looped over from Python
    before = limits(loaded.dtype)
    passes = engine_passes(engine)
    after = limits(loaded.dtype)
    near = {k: max(before[k] or 0, after[k] or 0) or None for k in before}
    bandwidth = near["memory_gbps"]
    bound_ms = nbytes / (bandwidth * 1e9) * 1000
    # a decode pass also reads every sequence's keys and values: at 512 tokens of context, 16
    # sequences' KV is ~70% of the default model's bf16 weights
    kv_ms = 16 * CONTEXT * engine.runner.layout.bytes_per_token / (bandwidth * 1e9) * 1000
    # 16 rows multiply every weight: at the measured decode-shaped GEMM rate that is a second
    # floor, above the weight read on a 2-core CPU
    compute_ms = 2 * params * 16 / (near["gemm_decode_gflops"] * 1e9) * 1000
    # the prefill chunk's GEMMs: every linear layer for each token, the lm_head for the last one
    # only; the embedding is a lookup (and a tied lm_head shares its weights: counted once above)
    embedding = loaded.model.get_input_embeddings().weight.numel()
    prefill_flops = 2 * (params - embedding) * CONTEXT + 2 * embedding
    prefill_gflops = prefill_flops / (passes["prefill_512"] / 1000) / 1e9
    return {"dtype": dtype, "forward": engine.forward_name, "attention": engine.runner.attention,
            "layer_steps": engine.layer_steps, "layer_loop": engine.layer_loop,
            "packed_linears": engine.packed_linears, "linear": engine.linear,
            "parameters": params, "weight_bytes": nbytes,
            "weight_read_ms": round(bound_ms, 2), "compute_16_rows_ms": round(compute_ms, 2),
            "limits_before": before, "limits_after": after, "limits": near, "pass_ms": passes,
            "decode_16x1_over_bound": round(passes["16x1"] / bound_ms, 2),
            "decode_16x1_over_max_bound": round(passes["16x1"] / max(bound_ms, compute_ms), 2),
            "kv_read_16x1_ms": round(kv_ms, 2),
            "decode_16x1_over_weights_and_kv": round(passes["16x1"] / (bound_ms + kv_ms), 2),
            "decode_1x1_over_bound": round(passes["1x1"] / bound_ms, 2),
            "prefill_gflops": round(prefill_gflops, 1),
            "prefill_of_gemm_rate": round(prefill_gflops / near["gemm_prefill_gflops"], 3),
            "prefill_of_peak": round(prefill_gflops / near["peak_gflops"], 3) if near["peak_gflops"] else None,
            "decode_16x1_profile": profile_decode(engine) if profiled else None,
            "prefill_512_profile": profile_prefill(engine) if profiled else None}


def measure(dtypes: tuple[str, ...] = ("float32", "bfloat16"), threads: int = 0, profiled: bool = False) -> dict:
    if threads:
        torch.set_num_threads(threads)
    out = {"chip": chip(), "gemm_gflops": {}, "memory_gbps": round(memory_gbps(), 2), "peak_gflops": peak_gflops()}
    for name in ("float32", "bfloat16"):
        dt = getattr(torch, name)
        out["gemm_gflops"][name] = {"prefill": round(gemm_gflops(dt, PREFILL_SHAPE), 1),
                                    "decode": round(gemm_gflops(dt, DECODE_SHAPE), 1)}
        peak = dtype_peak(out["peak_gflops"], dt)
        out["gemm_gflops"][name]["prefill_of_peak"] = round(out["gemm_gflops"][name]["prefill"] / peak, 3) if peak else None
    f32, b16 = out["gemm_gflops"]["float32"]["prefill"], out["gemm_gflops"]["bfloat16"]["prefill"]
    out["bf16_over_fp32_gemm"] = round(b16 / f32, 2)
    # each dtype without, then with, prepacked linear layers, both through the model's own forward,
    # then prepacked through the lean forward, then that with the native attention, then that
    # with the fused layer steps, then that with the native linear kernel where the engine picks
    # it, looping over the layers in Python, then the engine's default (that, with the layer loop
    # in C where the engine picks it): each step's gain in the same run
    steps = ((False, False, "torch", False, False, False), (True, False, "torch", False, False, False),
             (True, True, "torch", False, False, False), (True, True, "auto", False, False, False),
             (True, True, "auto", True, False, False), (True, True, "auto", True, True, False),
             (True, True, "auto", True, True, True))
    out["models"] = [model_figures(d, profiled and native and not loop, packed, lean, backend, fused, native, loop)
                     for d in dtypes for packed, lean, backend, fused, native, loop in steps]
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.bound", description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--dtypes", default="float32,bfloat16",
                   help="the default model's dtypes to time, comma-separated; 'auto': only the one the engine's "
                        "dtype `auto` runs on this CPU (bf16 where it has bf16 units, else fp32: a bf16 pass "
                        "emulated on a CPU without them takes minutes and says nothing the engine does)")
    p.add_argument("--profile", action="store_true",
                   help="also profile a 16-sequence decode pass and a prefill chunk by part and operator")
    p.add_argument("--out", type=Path, default=Path("bench-out/bound.json"))
    args = p.parse_args(argv)
    dtypes = tuple(args.dtypes.split(","))
    if dtypes == ("auto",):  # what the engine's dtype `auto` loads on this machine's CPU
        dtypes = (str(resolve_dtype("auto", torch.device("cpu"))).removeprefix("torch."),)
    elif unknown := [d for d in dtypes if d not in ("float32", "bfloat16")]:
        p.error(f"unknown --dtypes {', '.join(unknown)}; choose among float32, bfloat16, or 'auto' alone")
    report = measure(dtypes, args.threads, args.profile)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))
    print(json.dumps(report, indent=1))
    for m in report["models"]:
        print(f"{m['dtype']} ({m['forward']} forward, {m['attention']} attention, {m['layer_steps']} layer steps, "
              f"{m['layer_loop']} layer loop, "
              f"{m['packed_linears']} linear "
              f"layers prepacked, {m['linear']} linear): weights {m['weight_bytes'] / 1e6:.0f} MB, "
              f"read once in {m['weight_read_ms']} ms at {m['limits']['memory_gbps']} GB/s, 16 rows' GEMMs "
              f"{m['compute_16_rows_ms']} ms at the decode GEMM rate; decode 16x1 {m['pass_ms']['16x1']} ms = "
              f"{m['decode_16x1_over_bound']}x the weight read, {m['decode_16x1_over_max_bound']}x the larger "
              f"bound, {m['decode_16x1_over_weights_and_kv']}x the weights' and KV's read "
              f"({m['kv_read_16x1_ms']} ms of KV); decode 1x1 {m['pass_ms']['1x1']} ms; prefill {m['prefill_gflops']} GFLOP/s = "
              f"{m['prefill_of_gemm_rate']:.0%} of the {m['dtype']} GEMM rate "
              f"({m['limits']['gemm_prefill_gflops']} of {m['limits_before']['gemm_prefill_gflops']} / "
              f"{m['limits_after']['gemm_prefill_gflops']} GFLOP/s, measured before and after the passes)"
              + (f", {m['prefill_of_peak']:.0%} of the chip's {m['dtype']} peak ({m['limits']['peak_gflops']} GFLOP/s)"
                 if m["prefill_of_peak"] else ""),
              file=sys.stderr)
    peaks = ", ".join(f"{k} {v}" for k, v in report["peak_gflops"].items() if v)
    print(f"the chip's peak, GFLOP/s on {report['chip']['threads']} threads: {peaks or 'not measured (no C compiler)'}; "
          + "; ".join(f"{k} GEMM at the prefill shape {v['prefill']} = {v['prefill_of_peak']:.0%} of it"
                      for k, v in report["gemm_gflops"].items() if v["prefill_of_peak"]), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
