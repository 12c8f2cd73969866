"""The GPU kit (issue 20): what a session with a lent GPU runs, prepared and tested here.

    make gpu-bundle              # here: .gpu/ (wheels, the default model in parts, PLAN.md)
    make gpu-check DEVICE=cpu    # here: the same suite at small sizes
    make gpu-check               # there, after the calls .gpu/PLAN.md lists (docs/gpu.md)

The lent machine has no network, Python 3.12 with its own torch, triton and transformers, and
takes 64 MiB of files per call. `bundle` gathers what it lacks: Python 3.12 wheels of the
packages the check imports that its image does not hold (at the versions tested here), and the
default model's GGUF cut into parts that fit beside them, one part per call to a warm machine.

`check` runs, in one process, each stage on its own so that one failing stage leaves the others,
the measurements the GPU issue asks for first (a stage that would start after --deadline-s is
skipped and says how to run it alone):
  env           device, versions
  kernel-bench  python -m bench.verify: Triton against the torch reference and the bandwidth bound
  kernels       tests/kernels in Triton's interpreter, as `make test` runs them; on CUDA also the
                kernels' tests against their references with the kernels compiled, on the GPU
  exactness     random-weight models from real configs (SmolLM2-135M, Qwen2.5-0.5B, Llama-3.2-1B) in
                fp32 and bf16: batched speculative decoding against `none` one document at a time;
                every output identical, or where it first differs, the reference's top-2 masked
                logit gap
  pass-cost     one forward pass by (sequences, draft rows) on a random Llama-3.2-1B: rows -> ms, and
                each against the plain pass of as many sequences
  throughput    batched `none` decode tokens/s against one sequence at a time (the same model); on
                CUDA the largest batch again on the torch attention (a few steps), against the Triton one
  real-model    with --gguf: the default model's tokens per pass and tokens/s, batched against one
                at a time, for `none` and composite speculation
  imports       the distributions the run imported: bundled, in the image, or missing
and writes gpu-check.json and gpu-check.md into --out ($OUT there) after every stage. Figures go
to docs/benchmarks.md by hand, with the device and the date.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import importlib.metadata as md
import json
import os
import platform
import shutil
import subprocess
import sys
import time
import traceback
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]
MiB = 1024 * 1024
CALL_LIMIT = 64 * MiB  # the working tree plus carried paths, per call (the device tool's README)
# What the plan lets each call send (issue 32): headroom under CALL_LIMIT for files that appear in
# the tree between bundling and calling (a note, a log), more in the first call, which a bigger
# wheel would grow.
CALL_PLAN = (56 * MiB, 60 * MiB)

# Distributions the check imports that the lent image lacks (KINDS.md lists its packages; it
# has torch, triton, tokenizers, safetensors, accelerate, numpy, jinja2, pytest).
# Checked against what a CPU run of the check actually imports: `check` reports any import
# that is neither here nor in IMAGE_HAS.
# transformers too: the image's (5.17 when last read) is older than the one pinned and tested
# here, and the engine registers its own attention function with it; its requirements
# (huggingface-hub, tokenizers, safetensors) are met by the image's versions.
# google-re2: every user `pattern` runs on RE2 (structspec/grammar/regex.py), result checks included.
BUNDLED = ("llguidance", "jsonschema", "jsonschema-specifications", "referencing", "rpds-py", "gguf", "transformers",
           "google-re2")
IMAGE_HAS = ("torch", "triton", "tokenizers", "safetensors", "huggingface-hub", "accelerate",
             "numpy", "jinja2", "markupsafe", "pytest", "pluggy", "iniconfig", "packaging", "attrs", "pyyaml",
             "regex", "tqdm", "filelock", "fsspec", "requests", "typing-extensions", "sympy", "mpmath",
             "networkx", "hypothesis", "sortedcontainers", "psutil", "certifi", "charset-normalizer", "idna",
             "urllib3", "hf-xet", "httpx", "httpcore", "h11", "anyio", "sniffio", "click", "rich", "pygments",
             "markdown-it-py", "mdurl", "shellingham", "typer", "annotated-doc", "setuptools", "prometheus-client",
             "pillow", "scipy",
             # imported here by huggingface-hub 1.x; the image's huggingface-hub brings its own HTTP stack
             "httpx2", "httpcore2", "truststore")
# pip matches a wheel's manylinux tag exactly: every glibc level up to the image's (2.39)
PLATFORMS = tuple(f"manylinux_2_{n}_x86_64" for n in range(39, 4, -1)) + ("manylinux2014_x86_64",
                                                                          "manylinux1_x86_64", "linux_x86_64")

# Architectures to build random-weight models from. SmolLM2-135M's config is the default
# model's own (read from its converted folder here); the others restate the published configs
# of Qwen2.5-0.5B and Llama-3.2-1B. Every model uses the default tokenizer: a vocabulary larger
# than the tokenizer's has rows the grammar never allows, which keeps the logits' width (the
# kernels' V) real.
CONFIGS: dict[str, dict[str, Any]] = {
    "qwen2.5-0.5b": dict(model_type="qwen2", hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                         num_attention_heads=14, num_key_value_heads=2, vocab_size=151936, rope_theta=1000000.0,
                         max_position_embeddings=32768, rms_norm_eps=1e-6, tie_word_embeddings=True),
    "llama-3.2-1b": dict(model_type="llama", hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                         num_attention_heads=32, num_key_value_heads=8, head_dim=64, vocab_size=128256,
                         rope_theta=500000.0, max_position_embeddings=8192, rms_norm_eps=1e-5,
                         tie_word_embeddings=True),
}
TIMING_CONFIG = "llama-3.2-1b"  # the >= 1B config the pass-cost and throughput stages time


# --- bundle (runs here) --------------------------------------------------------------------------

def tree_bytes() -> int:
    """Bytes of what a call sends besides carried paths: tracked and untracked-not-ignored files."""
    names = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                           check=True, capture_output=True).stdout.split(b"\0")
    return sum((ROOT / n.decode()).stat().st_size for n in names if n and (ROOT / n.decode()).is_file())


LENT_PYTHON = "3.12"  # the lent image's Python (KINDS.md)


def download_wheels(dest: Path, names: tuple[str, ...] = BUNDLED, python_version: str = LENT_PYTHON) -> list[Path]:
    """manylinux wheels of `names` for `python_version` at the versions installed here."""
    dest.mkdir(parents=True, exist_ok=True)
    pins = [f"{n}=={md.version(n)}" for n in names]
    platforms = [a for p in PLATFORMS for a in ("--platform", p)]
    subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
                    "--python-version", python_version, "--implementation", "cp", *platforms, "-d", str(dest), *pins],
                   check=True)
    return sorted(dest.glob("*.whl"))


def split_file(path: Path, dest: Path, first: int, rest: int) -> list[Path]:
    """`path` cut into dest/model.gguf.partNN: the first part `first` bytes, the others `rest`."""
    dest.mkdir(parents=True, exist_ok=True)
    parts, size = [], path.stat().st_size
    with path.open("rb") as f:
        while f.tell() < size:
            chunk = f.read(first if not parts else rest)
            part = dest / f"model.gguf.part{len(parts):02d}"
            part.write_bytes(chunk)
            parts.append(part)
    return parts


def plan_calls(tree: int, wheels: int, model: int, limits: tuple[int, ...] = CALL_PLAN) -> list[int]:
    """Bytes of (compressed) model carried by each call: the first carries the wheels too, every
    call sends the tree, call i sends at most limits[i] (the last limit for any further call).
    Raises ValueError if the first call has no room or the model needs more than len(limits) calls."""
    first = limits[0] - tree - wheels
    if first <= 0:
        raise ValueError(f"the tree ({tree / MiB:.1f} MiB) and the wheels ({wheels / MiB:.1f} MiB) "
                         f"leave no room in a {limits[0] / MiB:.0f} MiB call")
    calls = [min(model, first)]
    for limit in limits[1:]:
        if sum(calls) < model:
            calls.append(min(limit - tree, model - sum(calls)))
    if sum(calls) < model:
        raise ValueError(f"the model ({model / MiB:.1f} MiB) needs more than {len(limits)} calls of "
                         f"{', '.join(f'{x / MiB:.0f}' for x in limits)} MiB")
    return calls


def compressed_model(gguf: Path, sha: str) -> Path:
    """`gguf` compressed with xz (preset 6: ~8% off the default model's Q4_1 GGUF, which is
    what fits it into two calls), cached by its sha256 in the cache dir. The `xz` program, where
    there is one, compresses on every core, in blocks (a little larger a file); Python's lzma, on
    one thread, otherwise. Either is one .xz stream, which the last call's Python lzma reads."""
    import lzma

    from structspec.config import Settings

    path = Settings.from_env().cache_dir / "gpu-kit" / f"{sha}.gguf.xz"
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        xz = shutil.which("xz")
        if xz:
            with tmp.open("wb") as dst:
                subprocess.run([xz, "-6", "-T0", "-c", str(gguf)], stdout=dst, check=True)
        else:
            with gguf.open("rb") as src, lzma.open(tmp, "wb", preset=6) as dst:
                shutil.copyfileobj(src, dst, 1 << 20)
        tmp.replace(path)
    return path


def bundle(out: Path, gguf: Path | None, python_version: str = LENT_PYTHON) -> dict[str, Any]:
    """Fill `out` (ignored by git) and write out/PLAN.md: the device calls, in order.
    `python_version`: the wheels' (the rehearsal bundles for the Python here)."""
    from structspec.engine.model_files import default_gguf_path

    shutil.rmtree(out, ignore_errors=True)
    wheels = download_wheels(out / "wheels", python_version=python_version)
    model_files = default_model_dir()
    (out / "wheels" / "tokenizer").mkdir()  # carried with the wheels, in the first call
    for name in TOKENIZER_FILES:
        if (model_files / name).is_file():
            shutil.copy(model_files / name, out / "wheels" / "tokenizer" / name)
    gguf = gguf or default_gguf_path()
    sha = hashlib.sha256(gguf.read_bytes()).hexdigest()
    packed = compressed_model(gguf, sha)
    tree = tree_bytes()
    wheel_bytes = sum(f.stat().st_size for f in (out / "wheels").rglob("*") if f.is_file())
    calls = plan_calls(tree, wheel_bytes, packed.stat().st_size)
    parts = split_file(packed, out / "model", calls[0], calls[1] if len(calls) > 1 else calls[0])
    rel = lambda p: str(p.relative_to(ROOT)) if p.is_relative_to(ROOT) else str(p)  # noqa: E731
    steps = []
    for i, part in enumerate(parts):
        carry = [rel(out / "wheels"), rel(part)] if i == 0 else [rel(part)]
        sent = tree + sum((ROOT / c).stat().st_size if (ROOT / c).is_file() else
                          sum(f.stat().st_size for f in (ROOT / c).rglob("*") if f.is_file()) for c in carry)
        last = i == len(parts) - 1
        steps.append({"carry": carry, "bytes": sent,
                      "command": stage_command(rel(out), part.name, i == 0, last, sha)})
    summary = {"wheels": [w.name for w in wheels], "wheel_bytes": wheel_bytes, "tree_bytes": tree,
               "model": str(gguf), "model_bytes": gguf.stat().st_size, "compressed_bytes": packed.stat().st_size,
               "sha256": sha, "limits": list(CALL_PLAN), "calls": steps}
    (out / "PLAN.md").write_text(plan_markdown(summary))
    (out / "bundle.json").write_text(json.dumps(summary, indent=1))
    return summary


# random weights; the checks of correctness before the long timing loop, which stops at the
# deadline and says what it left (the kernel tests once ran out of time behind it)
FIRST_CALL_STAGES = ("kernel-bench", "kernels", "exactness", "pass-cost", "throughput")
LAST_CALL_STAGES = ("real-model", "hf-peer")  # the default model's weights, whose parts the calls carry
CHECK = ("set -o pipefail; HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/gpukit/site:$PWD "
         "python3 -m bench.gpu check --device cuda --tokenizer /tmp/gpukit/tokenizer")


def over_plan(summary: dict[str, Any]) -> str:
    """'' if every call of a bundle's summary sends at most its CALL_PLAN limit; else which do not."""
    limits = list(CALL_PLAN) + [CALL_PLAN[-1]] * len(summary["calls"])
    return "; ".join(f"call {i} sends {c['bytes'] / MiB:.1f} MiB > {limit / MiB:.0f}"
                     for i, (c, limit) in enumerate(zip(summary["calls"], limits), 1) if c["bytes"] > limit)


def stage_command(bundle_dir: str, part: str, first: bool, last: bool, gguf_sha256: str = "") -> str:
    """The shell command of one call: stage its files outside the repo (they survive while the
    machine is warm, 30 s after a call). The first call installs the wheels and runs the
    random-weight stages; the last assembles the model, checks it against the bundle's sha256
    (exit 3, saying so, when an earlier call's part is gone: the machine went back between
    calls) and runs the real-model stages. Each writes its report and log into $OUT as it goes."""
    cmd = f"mkdir -p /tmp/gpukit/model && cp {bundle_dir}/model/{part} /tmp/gpukit/model/"
    if first:
        cmd += (f" && cp -r {bundle_dir}/wheels/tokenizer /tmp/gpukit/ && python3 -m pip install -q --no-index "
                f"--no-deps --no-compile --no-cache-dir --upgrade --target /tmp/gpukit/site {bundle_dir}/wheels/*.whl"
                f" && {{ {CHECK} --stages {','.join(FIRST_CALL_STAGES)} 2>&1 | tee $OUT/check-1.log; }}")
    if last:  # what `make gpu-check GGUF=...` runs, without needing make there
        cmd += (" && cat /tmp/gpukit/model/model.gguf.part* | python3 -c 'import lzma, shutil, sys; "
                "shutil.copyfileobj(lzma.open(sys.stdin.buffer), sys.stdout.buffer)' > /tmp/gpukit/model.gguf; "
                f"{{ echo '{gguf_sha256}  /tmp/gpukit/model.gguf' | sha256sum -c --quiet || "
                "{ echo 'gpu-check: the model parts staged by the earlier call are gone (the machine went back '"
                "'between calls): start again from call 1'; exit 3; }; } && "
                f"{{ {CHECK} --gguf /tmp/gpukit/model.gguf --stages {','.join(LAST_CALL_STAGES)} "
                "2>&1 | tee $OUT/check-2.log; }")
    return cmd


def plan_markdown(s: dict[str, Any]) -> str:
    lines = ["# GPU kit: the device calls, in order", "",
             f"Wheels: {len(s['wheels'])} ({s['wheel_bytes'] / MiB:.1f} MiB): {', '.join(s['wheels'])}.",
             f"Tree sent by every call: {s['tree_bytes'] / MiB:.1f} MiB. Model: {s['model_bytes'] / MiB:.1f} MiB, "
             f"{s['compressed_bytes'] / MiB:.1f} MiB compressed, in {len(s['calls'])} parts.", "",
             "Make the calls back to back: the machine stays warm 30 s after a call, and the staged files "
             "in /tmp/gpukit go with it. The first call runs the random-weight stages "
             f"({', '.join(FIRST_CALL_STAGES)}), the last the real-model ones ({', '.join(LAST_CALL_STAGES)}); "
             "each stops starting work at its deadline (520 s) and says what it left. If the last call "
             "exits 3, the machine went back: start again from call 1.", "",
             "To re-run skipped stages while the machine is warm (every file is staged by then):", "",
             "   ```sh", f"   {CHECK} --gguf /tmp/gpukit/model.gguf --stages NAME,NAME 2>&1 | tee $OUT/check-3.log",
             "   ```", ""]
    for i, c in enumerate(s["calls"], 1):
        lines += [f"{i}. carry {json.dumps(c['carry'])} ({c['bytes'] / MiB:.1f} MiB sent), timeout_s 600:", "",
                  "   ```sh", f"   {c['command']}", "   ```", ""]
    lines += ["The last call's $OUT holds gpu-check.json and gpu-check.md.", ""]
    return "\n".join(lines)


# --- rehearse (runs here, in the rehearsal venv) --------------------------------------------------

# Seconds of each stage on an H200 (docs/gpu.md, "Time"): the largest of the runs there
# (2026-11-26 and -27; the third machine ran every launch-bound pass ~2x slower), rounded up with
# room; throughput's from its shortened torch-attention row. Each call's stages must fit its 520 s
# deadline, and both calls with a machine start must fit the 15 device minutes a lent task has.
STAGE_ESTIMATE_S = {"kernel-bench": 20, "kernels": 60, "exactness": 150, "pass-cost": 20, "throughput": 90,
                    "real-model": 200, "hf-peer": 140}
DEVICE_BUDGET_S = 900
MACHINE_START_S = 60  # a start, the transfers and the wheels' install, per call at most
DEADLINE_S = 520


def rehearse(bundle_dir: Path, out: Path) -> int:
    """The bundle's calls, run here as the device would run them: each call's command from its
    summary, with `--device cpu` (small sizes) and this Python for python3, the network cut
    (`unshare -rn`) where this machine allows it, /tmp/gpukit wiped first; the first call's
    files staged for the next exactly as on a warm machine. Then every stage of every call must
    be ok. Returns a process exit status."""
    summary = json.loads((bundle_dir / "bundle.json").read_text())
    shutil.rmtree("/tmp/gpukit", ignore_errors=True)
    cut = ["unshare", "-rn"] if shutil.which("unshare") and subprocess.run(
        ["unshare", "-rn", "true"], capture_output=True).returncode == 0 else []
    print(f"gpu-rehearse: {len(summary['calls'])} calls, network {'cut (unshare -rn)' if cut else 'NOT cut'}")
    failed = []
    for i, call in enumerate(summary["calls"], 1):
        call_out = out / f"call-{i}"
        shutil.rmtree(call_out, ignore_errors=True)
        call_out.mkdir(parents=True)
        cmd = (call["command"].replace("--device cuda", f"--device cpu --deadline-s {DEADLINE_S}")
               .replace("python3 ", f"{sys.executable} "))
        t = time.perf_counter()
        proc = subprocess.run([*cut, "bash", "-c", cmd], cwd=ROOT, env={**os.environ, "OUT": str(call_out)})
        seconds = time.perf_counter() - t
        report = call_out / "gpu-check.json"
        stages = json.loads(report.read_text())["stages"] if report.is_file() else {}
        bad = [n for n, st in stages.items() if not st.get("ok") or st.get("skipped") or st.get("truncated")]
        print(f"gpu-rehearse: call {i}: exit {proc.returncode}, {seconds:.0f} s, stages "
              + ", ".join(f"{n} {st.get('seconds', '-')} s" for n, st in stages.items()))
        if proc.returncode != 0 or not stages or bad:
            failed.append(f"call {i} (exit {proc.returncode}; stages not ok: {', '.join(bad) or 'no report'})")
    if failed:
        print(f"gpu-rehearse: FAILED: {'; '.join(failed)} (reports under {out})", file=sys.stderr)
        return 1
    print(f"gpu-rehearse: every call ran every stage (reports under {out})")
    return 0


# --- check (runs there; DEVICE=cpu here at small sizes) -----------------------------------------------

_deadline: float | None = None  # monotonic time past which stages stop starting work (Report sets it)
_report_dir: Path | None = None  # where the report goes; stages put their raw logs beside it


def time_left() -> float:
    """Seconds before the run's deadline (inf without one). Stages check it inside their loops:
    the device tool kills a command at 600 s, and a stage killed mid-way writes nothing."""
    return float("inf") if _deadline is None else _deadline - time.monotonic()


def subprocess_timeout(floor: float = 30) -> float:
    """A child's timeout: the time left, at least `floor` s, at most 540 s."""
    return max(floor, min(540.0, time_left()))


class Report:
    """Stages' results, written as JSON and Markdown after every stage (a killed run keeps them)."""

    def __init__(self, out: Path, device: str, deadline_s: float = 0):
        global _deadline, _report_dir
        self.out, self.device = out, device
        _report_dir = out
        self.stages: dict[str, dict[str, Any]] = {}
        self.deadline = _deadline = time.monotonic() + deadline_s if deadline_s > 0 else None
        out.mkdir(parents=True, exist_ok=True)

    def stage(self, name: str, fn: Callable[[], dict[str, Any]]) -> None:
        if self.deadline is not None and time.monotonic() > self.deadline:
            self.stages[name] = {"ok": True, "skipped": "past --deadline-s: run it alone with --stages " + name}
            self.write()
            return
        print(f"gpu-check: {name} ...", file=sys.stderr, flush=True)
        t = time.perf_counter()
        try:
            result = {"ok": True, **fn()}
        except Exception as e:  # reported; the other stages still run
            result = {"ok": False, "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-4000:]}
        result["seconds"] = round(time.perf_counter() - t, 1)
        self.stages[name] = result
        print(f"gpu-check: {name}: {'ok' if result['ok'] else result['error']} ({result['seconds']} s)",
              file=sys.stderr, flush=True)
        self.write()

    def write(self) -> None:
        (self.out / "gpu-check.json").write_text(json.dumps({"device": self.device, "stages": self.stages},
                                                            indent=1, default=str))
        (self.out / "gpu-check.md").write_text(report_markdown(self.device, self.stages))


def env_stage(device: str) -> dict[str, Any]:
    import torch

    info: dict[str, Any] = {"python": platform.python_version(), "torch": torch.__version__,
                            "cuda": torch.version.cuda, "device": device}
    for name in ("triton", "transformers", "llguidance", "tokenizers"):
        with contextlib.suppress(md.PackageNotFoundError):
            info[name] = md.version(name)
    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        info.update(gpu=props.name, sms=props.multi_processor_count, memory_gib=round(props.total_memory / 2**30, 1))
    else:
        info["cpu"] = platform.processor() or platform.machine()
        info["threads"] = torch.get_num_threads()
    return info


def subprocess_env() -> dict[str, str]:
    """This process's environment with the repository first on PYTHONPATH (the staged wheels stay)."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}


def run_kernel_tests(device: str, small: bool) -> dict[str, Any]:
    """On CUDA: the kernel-against-reference tests with the kernels compiled, on the GPU's tensors
    (STRUCTSPEC_KERNEL_TESTS=cuda; the engine tests among them skip there, saying why). On a CPU:
    tests/kernels in Triton's interpreter, as `make test` runs them. Not the interpreter on the
    device: `make test` runs it on every CI run, and the lent image's Triton 3.6 interpreter
    breaks on its NumPy >= 2.4, which once failed the stage before its compiled half ran."""
    args = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rf"]
    files = [f"tests/kernels/test_{name}.py" for name in ("bitmask", "greedy", "sampling", "attention")]
    if device == "cuda":
        return {"compiled": _pytest(args + files, {"STRUCTSPEC_KERNEL_TESTS": "cuda"}, drop=("TRITON_INTERPRET",))}
    # A CPU (the rehearsal, or a check here): the device's selection collected with the device's
    # settings, so that an import or parametrisation that breaks under the bundle's versions
    # shows before a GPU is lent; `make test` runs these tests in the interpreter.
    collected = _pytest(args + ["--collect-only"] + files, {"STRUCTSPEC_KERNEL_TESTS": "cuda"},
                        drop=("TRITON_INTERPRET",))
    return {"summary": f"on the CPU, the device's selection collected (make test runs it in the interpreter): "
                       f"{collected}"}


def _pytest(args: list[str], env_set: dict[str, str], drop: tuple[str, ...] = ()) -> str:
    """Run pytest; its summary line, or RuntimeError with the tail of its output."""
    env = {k: v for k, v in subprocess_env().items() if k not in drop} | env_set
    proc = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=subprocess_timeout())
    if _report_dir is not None:  # the whole output comes back with the report
        (_report_dir / "kernel-tests.log").write_text(proc.stdout + proc.stderr)
    tail = (proc.stdout + proc.stderr).strip().splitlines()
    summary = next((line for line in reversed(tail) if any(w in line for w in (" passed", " failed", " error",
                                                                                 " collected", "tests collected"))),
                   tail[-1] if tail else "")
    if proc.returncode != 0:
        raise RuntimeError(f"kernel tests: {summary}\n" + "\n".join(tail[-40:]))
    return summary


def run_kernel_bench(device: str, small: bool) -> dict[str, Any]:
    args = [sys.executable, "-m", "bench.verify", "--device", device] + (["--quick"] if small else [])
    proc = subprocess.run(args, cwd=ROOT, env=subprocess_env(), capture_output=True, text=True,
                          timeout=subprocess_timeout())
    if proc.returncode != 0:
        raise RuntimeError((proc.stdout + proc.stderr)[-3000:])
    return {"markdown": proc.stdout.strip()}


TOKENIZER_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                   "chat_template.jinja", "special_tokens_map.json")


def default_model_dir() -> Path:
    """The default model's converted folder here (converted from its GGUF on first use)."""
    from structspec.config import Settings
    from structspec.engine.model import model_dir

    path, _ = model_dir("default", Settings.from_env().cache_dir)
    return Path(path)


def kernel_backend(device: str) -> str:
    """Triton where it compiles (auto: Triton on CUDA); the torch reference on a CPU, where
    Triton would only run in its interpreter (which `make test` turns on for its kernel tests)."""
    return "auto" if device == "cuda" else "torch"


def tokenizer_and_config(folder: Path):
    """The tokenizer in `folder` (the default model's files) and its config (a dict)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder)), json.loads((folder / "config.json").read_text())


def random_model(name: str, base: dict[str, Any], tok, device: str, dtype, small: bool, seed: int = 0):
    """A LoadedModel with random weights at the config's own initialisation. Small: 2 layers
    and narrow, the vocabulary kept."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from structspec.engine.model import from_model

    cfg = dict(base)
    if small:
        cfg.update(num_hidden_layers=2, hidden_size=128, intermediate_size=256, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=32)
    model_type = cfg.pop("model_type")
    keep = {k: v for k, v in cfg.items() if not k.startswith(("_", "transformers_version", "architectures",
                                                              "torch_dtype", "dtype", "auto_map"))}
    keep.update(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=None)
    keep["vocab_size"] = max(int(keep.get("vocab_size", 0)), len(tok))
    config = AutoConfig.for_model(model_type, **keep)
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, torch_dtype=dtype).eval()
    return from_model(model, tok, name=f"random {name}{' (small)' if small else ''}")


def documents(n: int) -> list[tuple[dict, str]]:
    """The n shortest DeepJSONEval documents of the test fixture (Apache-2.0, tests/fixtures/NOTICE.md),
    their schemas bounded (random models otherwise run to max_tokens in arrays and digits)."""
    from bench.exactness import bounded

    path = ROOT / "tests" / "fixtures" / "deepjsoneval_sample.jsonl"
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    rows.sort(key=lambda r: (len(r["text"]), r["id"]))
    return [(bounded(r["schema"]), r["text"]) for r in rows[:n]]


def exactness_stage(tok, configs: dict[str, dict], device: str, small: bool) -> dict[str, Any]:
    """Per (config, dtype): batched speculative outputs (composite, schema and ngram, k 8, all
    at once) against `none` alone."""
    import torch

    from bench.exactness import compare
    from structspec.engine.engine import Engine, Request
    from structspec.options import RequestOptions

    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16}
    docs = documents(4 if small else 12)
    max_tokens = 48 if small else 96
    results: list[dict] = []
    for name, base in configs.items():
        for dname, dtype in dtypes.items():
            if time_left() < 60:
                return {"runs": results, "truncated": f"out of time before {name} {dname}: run --stages exactness alone"}
            loaded = random_model(name, base, tok, device, dtype, small)
            alone = Engine(loaded, kernel_backend=kernel_backend(device), engine_max_seqs=1)
            refs = alone.run([Request(s, d, RequestOptions(strategy="none", draft_len=0, max_tokens=max_tokens,
                                                           verbatim=True), trace=True) for s, d in docs])
            batched = Engine(loaded, kernel_backend=kernel_backend(device), engine_max_seqs=16)
            strategies = ("composite", "schema", "ngram")
            reqs = [Request(s, d, RequestOptions(strategy=strategies[i % 3], draft_len=8, max_tokens=max_tokens,
                                                 verbatim=True)) for i, (s, d) in enumerate(docs)]
            got = batched.run(reqs)
            identical, gaps, accepted = 0, [], 0
            for ref, out in zip(refs, got):
                accepted += out.stats.accepted
                d = compare(ref, out)
                if d is None:
                    identical += 1
                else:
                    gaps.append({"index": d.index, "gap": d.gap, "top": d.top})
            results.append({"config": name, "dtype": dname, "documents": len(docs), "identical": identical,
                            "diverged": gaps, "accepted_draft_tokens": accepted,
                            "finished": sum(r.status == "succeeded" for r in refs)})
            del alone, batched, loaded
            if device == "cuda":
                torch.cuda.empty_cache()
    return {"runs": results}


def pass_cost_stage(tok, base: dict, device: str, small: bool) -> dict[str, Any]:
    import torch

    from bench.passes import pass_shapes
    from structspec.engine.engine import Engine

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    loaded = random_model(TIMING_CONFIG, base, tok, device, dtype, small)
    engine = Engine(loaded, kernel_backend=kernel_backend(device), engine_max_seqs=64, engine_kv_budget_mb=1 << 16)
    seqs = (1, 4) if small else (1, 2, 4, 8, 16, 32, 64)
    ks = (0, 4) if small else (0, 1, 2, 4, 8, 16)
    shapes = tuple((b, k + 1) for b in seqs for k in ks)
    rows = pass_shapes(engine, (128,) if small else (512,), repeats=3 if small else 10, shapes=shapes)
    plain = {r["sequences"]: r["ms"] for r in rows if r["rows_each"] == 1}
    for r in rows:
        r["k"] = r["rows_each"] - 1
        r["vs_plain"] = round(r["ms"] / plain[r["sequences"]], 3)
    return {"model": loaded.name, "dtype": str(dtype).removeprefix("torch."), "attention": engine.runner.attention,
            "rows": rows}


def timed_run(loaded, device: str, max_seqs: int, schema: dict, docs: list[str], opts, backend: str | None = None,
              **settings) -> dict[str, Any]:
    """One engine at `max_seqs`: a warm-up request (compile, allocate, learn the schema prefix),
    then every document of `docs` timed together. `backend`: the engine's kernel_backend
    (default: kernel_backend(device))."""
    from structspec.engine.engine import Engine, Request

    import torch

    engine = Engine(loaded, kernel_backend=backend or kernel_backend(device), engine_max_seqs=max_seqs, **settings)
    engine.run([Request(schema, docs[0], opts)])
    engine.metrics = type(engine.metrics)()  # the timed documents' steps alone
    engine.sync_timing = device == "cuda"
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    t = time.perf_counter()
    results = engine.run([Request(schema, d, opts) for d in docs])
    wall = time.perf_counter() - t
    tokens = sum(r.stats.output_tokens for r in results)
    passes = sum(r.stats.target_passes for r in results)
    m = engine.metrics
    per_step = lambda s: round(1e3 * s / m.steps, 2) if m.steps else None  # noqa: E731
    return {"max_seqs": max_seqs, "attention": engine.runner.attention, "documents": len(results),
            "output_tokens": tokens,
            "tokens_per_pass": round(tokens / passes, 2) if passes else None, "wall_s": round(wall, 3),
            "tok_s": round(tokens / wall, 1), "steps": m.steps, "step_ms": per_step(m.step_s),
            "forward_ms": per_step(m.forward_s), "verify_ms": per_step(m.verify_s),
            "host_ms": per_step(m.step_s - m.forward_s - m.verify_s),
            "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if device == "cuda" else None}


def throughput_stage(tok, base: dict, device: str, small: bool) -> dict[str, Any]:
    """Batched `none` decode against one sequence at a time, random weights, receipts."""
    import torch

    from bench.receipts import RECEIPT_SCHEMA, receipts
    from structspec.options import RequestOptions

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    loaded = random_model(TIMING_CONFIG, base, tok, device, dtype, small)
    schema = json.loads(RECEIPT_SCHEMA.read_text())
    batch_sizes = (1, 4) if small else (1, 8, 32, 64)
    docs = [r["text"] for r in receipts(2 * max(batch_sizes), seed=7)]
    opts = RequestOptions(strategy="none", draft_len=0, max_tokens=16 if small else 64)
    out: list[dict] = []
    result: dict[str, Any] = {"model": loaded.name, "runs": out}
    for b in batch_sizes:  # a rate needs a few documents per slot, and batch 1's 16 give it (128 took 1.5 min)
        if time_left() < 45:
            result["truncated"] = f"out of time before max_seqs {b}: run --stages throughput alone"
            break
        out.append(timed_run(loaded, device, b, schema, docs[:max(16 if not small else 4, 2 * b)], opts,
                             engine_kv_budget_mb=1 << 16))
    if out and out[-1]["attention"] == "triton" and time_left() >= 45:
        # the same largest batch on the torch attention: what the attention kernel earns. Its
        # steps are ~100x slower (1.8 s each on the third H200 run), so one document a slot and
        # 16 tokens each: a step rate from ~16 steps, not the 130 that took 190-260 s of the call
        b = out[-1]["max_seqs"]
        out.append(timed_run(loaded, device, b, schema, docs[:b], replace(opts, max_tokens=16),
                             backend="torch", engine_kv_budget_mb=1 << 16))
    base_rate = out[0]["tok_s"] if out else None
    for r in out:
        r["vs_1"] = round(r["tok_s"] / base_rate, 2) if base_rate else None
    return result


def real_model_stage(gguf: Path, device: str, small: bool) -> dict[str, Any]:
    """The default model's weights: e-mails and receipts, `none` and composite k 8, batched
    and alone; tokens per pass is what speculation earns."""
    from bench.contacts import contacts
    from bench.receipts import receipts
    from structspec.engine.model import load_model
    from structspec.options import RequestOptions

    loaded = load_model(str(gguf), device=device, dtype="auto")
    n = 4 if small else 24
    sets = {"contact": ([r["text"] for r in contacts(n, seed=3)], "contact.json"),
            "receipt": ([r["text"] for r in receipts(n, seed=3)], "receipt.json")}
    out: list[dict] = []
    result: dict[str, Any] = {"model": loaded.name, "dtype": str(next(loaded.model.parameters()).dtype), "runs": out}
    for b in ((4, 1) if small else (24, 1)):  # batched first: the one at a time runs are the slow ones
        for set_name, (docs, schema_file) in sets.items():
            schema = json.loads((ROOT / "schemas" / schema_file).read_text())
            for strategy, k in (("none", 0), ("composite", 8)):
                if time_left() < 60:
                    result["truncated"] = f"out of time before {set_name} {strategy} max_seqs {b}"
                    return result
                opts = RequestOptions(strategy=strategy, draft_len=k, max_tokens=32 if small else 96)
                out.append({"set": set_name, "strategy": strategy, "k": k,
                            **timed_run(loaded, device, b, schema, docs, opts)})
    return result


def hf_peer_stage(gguf: Path, device: str, small: bool) -> dict[str, Any]:
    """The peer that needs no extra files: transformers' own generate on the same weights and
    prompts, greedy and with prompt lookup (8 tokens), one receipt at a time. It is not
    constrained: its tokens/s is the plain decoding a user could run instead, and the share of
    its outputs that parse and match the schema is reported beside it."""
    import jsonschema
    import torch

    from bench.receipts import receipts
    from structspec.engine.model import load_model
    from structspec.engine.prompt import build_prompt

    loaded = load_model(str(gguf), device=device, dtype="auto")
    tok, model = loaded.tokenizer, loaded.model
    schema = json.loads((ROOT / "schemas" / "receipt.json").read_text())
    docs = [r["text"] for r in receipts(4 if small else 24, seed=3)]
    prompts = [torch.tensor([build_prompt(tok, schema, d, loaded.context_len)], device=loaded.device) for d in docs]
    max_new = 32 if small else 96
    out: list[dict] = []
    result: dict[str, Any] = {"model": loaded.name, "dtype": str(next(model.parameters()).dtype), "runs": out}
    for name, extra in (("greedy", {}), ("prompt lookup 8", {"prompt_lookup_num_tokens": 8})):
        if time_left() < 45:
            result["truncated"] = f"out of time before {name}"
            break
        gen = dict(max_new_tokens=max_new, do_sample=False, pad_token_id=tok.eos_token_id, **extra)
        with torch.inference_mode():
            model.generate(prompts[0], **gen)  # warm-up
            tokens, valid = 0, 0
            t = time.perf_counter()
            for ids in prompts:
                new = model.generate(ids, **gen)[0, ids.shape[1]:]
                tokens += int(new.numel())
                with contextlib.suppress(ValueError, jsonschema.ValidationError):
                    jsonschema.validate(json.loads(tok.decode(new, skip_special_tokens=True)), schema)
                    valid += 1
            wall = time.perf_counter() - t
        out.append({"peer": f"transformers {name}", "max_seqs": 1, "documents": len(prompts), "output_tokens": tokens,
                    "wall_s": round(wall, 3), "tok_s": round(tokens / wall, 1), "schema_valid": valid})
    return result


def third_party_imports() -> dict[str, list[str]]:
    """Distributions of the modules imported so far, split into bundled, in the image, and neither."""
    dists = md.packages_distributions()
    seen = set()
    for mod in list(sys.modules):
        top = mod.split(".")[0]
        for d in dists.get(top, []):
            seen.add(d.lower().replace("_", "-"))
    bundled = {b.lower() for b in BUNDLED}
    image = {i.lower() for i in IMAGE_HAS}
    return {"bundled": sorted(seen & bundled), "image": sorted(seen & image),
            "missing": sorted(seen - bundled - image - {"structspec"})}


STAGES = FIRST_CALL_STAGES + LAST_CALL_STAGES  # run order


def check(device: str, out: Path, tokenizer: Path, gguf: Path | None, small: bool,
          stages: set[str] | None = None, deadline_s: float = 0) -> Report:
    """Run `stages` (default: all; real-model only with `gguf`) in STAGES' order, the measurements
    the GPU issue asks for first; a stage that would start after `deadline_s` is skipped."""
    import torch

    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("gpu-check: --device cuda, but torch sees no CUDA device")
    unknown = (stages or set()) - set(STAGES)
    if unknown:
        raise SystemExit(f"gpu-check: unknown stage(s) {', '.join(sorted(unknown))}; stages: {', '.join(STAGES)}")
    report = Report(out, device, deadline_s)
    report.stage("env", lambda: env_stage(device))
    tok, smollm = tokenizer_and_config(tokenizer)
    configs = {"smollm2-135m": {**smollm, "model_type": smollm.get("model_type", "llama")}, **CONFIGS}
    if small:
        configs = {k: configs[k] for k in ("smollm2-135m", "qwen2.5-0.5b")}
    timing = CONFIGS[TIMING_CONFIG]
    run = {"kernel-bench": lambda: run_kernel_bench(device, small),
           "pass-cost": lambda: pass_cost_stage(tok, timing, device, small),
           "throughput": lambda: throughput_stage(tok, timing, device, small),
           "exactness": lambda: exactness_stage(tok, configs, device, small),
           "kernels": lambda: run_kernel_tests(device, small),
           "real-model": lambda: real_model_stage(gguf, device, small),
           "hf-peer": lambda: hf_peer_stage(gguf, device, small)}
    for name in STAGES:
        if (stages is None or name in stages) and (name not in LAST_CALL_STAGES or gguf is not None):
            report.stage(name, run[name])
    report.stage("imports", third_party_imports)
    return report


# --- report -------------------------------------------------------------------------------

def largest_gap(diverged: list[dict]) -> dict[str, Any]:
    """The exactness row's largest top-2 gap at a divergence, the reference's top logit there
    and the gap in bf16 steps of that logit's size (reports from before the top was recorded
    have none: those cells stay empty)."""
    from bench.exactness import bf16_steps

    known = [d for d in diverged if d.get("gap") is not None]
    if not known:
        return {"largest gap at a divergence": None, "its top logit": None, "in bf16 steps": None}
    d = max(known, key=lambda d: d["gap"])
    top = d.get("top")
    return {"largest gap at a divergence": d["gap"], "its top logit": top,
            "in bf16 steps": None if top is None else round(bf16_steps(d["gap"], top), 2)}


def _table(rows: list[dict], cols: list[str]) -> list[str]:
    def cell(v):
        return "" if v is None else (f"{v:g}" if isinstance(v, float) else str(v))
    return ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)] + \
        ["| " + " | ".join(cell(r.get(c)) for c in cols) + " |" for r in rows]


def report_markdown(device: str, stages: dict[str, dict[str, Any]]) -> str:
    lines = [f"# gpu-check on {device}", ""]
    for name, s in stages.items():
        if s.get("skipped"):
            lines += [f"## {name} (skipped)", "", s["skipped"], ""]
            continue
        lines += [f"## {name} ({'ok' if s.get('ok') else 'FAILED'}, {s.get('seconds')} s)", ""]
        if s.get("truncated"):
            lines += [f"Truncated: {s['truncated']}.", ""]
        if not s.get("ok"):
            lines += ["```", s.get("error", ""), s.get("traceback", ""), "```", ""]
            continue
        if name in ("env", "imports"):
            lines += [f"- {k}: {v}" for k, v in s.items() if k not in ("ok", "seconds")] + [""]
        elif name == "kernels":
            lines += [f"compiled on the GPU: {s['compiled']}" if "compiled" in s else s["summary"], ""]
        elif name == "kernel-bench":
            lines += [s["markdown"], ""]
        elif name == "exactness":
            rows = [{**r, "diverged": len(r["diverged"]), **largest_gap(r["diverged"])} for r in s["runs"]]
            lines += _table(rows, ["config", "dtype", "documents", "identical", "diverged",
                                   "largest gap at a divergence", "its top logit", "in bf16 steps",
                                   "accepted_draft_tokens"]) + [""]
        elif name == "pass-cost":
            lines += [f"{s['model']}, {s['dtype']}, {s['attention']} attention", ""]
            lines += _table(s["rows"], ["context", "sequences", "k", "rows", "ms", "vs_plain"]) + [""]
        elif name == "throughput":
            lines += [s["model"], ""] + _table(s["runs"], ["max_seqs", "attention", "documents", "output_tokens",
                                                           "wall_s", "tok_s", "step_ms", "forward_ms", "verify_ms",
                                                           "host_ms", "peak_gib", "vs_1"]) + [""]
        elif name == "hf-peer":
            lines += [f"{s['model']}, {s['dtype']}, unconstrained", ""]
            lines += _table(s["runs"], ["peer", "max_seqs", "documents", "output_tokens", "wall_s", "tok_s",
                                        "schema_valid"]) + [""]
        elif name == "real-model":
            lines += [f"{s['model']}, {s['dtype']}", ""]
            lines += _table(s["runs"], ["set", "strategy", "k", "max_seqs", "documents", "output_tokens",
                                        "tokens_per_pass", "wall_s", "tok_s", "step_ms", "forward_ms", "verify_ms",
                                        "host_ms"]) + [""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.gpu", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("bundle", help="gather .gpu/ for the device calls (here)")
    b.add_argument("--out", type=Path, default=ROOT / ".gpu")
    b.add_argument("--gguf", type=Path, default=None, help="model to carry (default: the default model's GGUF)")
    b.add_argument("--python-version", default=LENT_PYTHON, help="the wheels' Python (default: the lent image's)")
    r = sub.add_parser("rehearse", help="run a bundle's calls here with --device cpu, the network cut")
    r.add_argument("--bundle", type=Path, default=ROOT / ".gpu-rehearse")
    r.add_argument("--out", type=Path, default=ROOT / "bench-out" / "gpu-rehearse")
    c = sub.add_parser("check", help="run the suite on --device and write the report into --out")
    c.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    c.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or ROOT / "bench-out" / "gpu"))
    c.add_argument("--gguf", type=Path, default=None, help="the default model's GGUF, for the real-model stage")
    c.add_argument("--tokenizer", type=Path, default=None,
                   help="folder with the default model's tokenizer and config (default: its converted folder here)")
    c.add_argument("--small", action="store_true", help="small sizes (the default on a CPU)")
    c.add_argument("--stages", default=None, help=f"comma-separated subset of {', '.join(STAGES)}")
    c.add_argument("--deadline-s", type=float, default=None,
                   help="skip the stages that would start after this many seconds (default: 520 on CUDA, "
                        "inside the device tool's 600 s per command; none on a CPU)")
    args = p.parse_args(argv)
    if args.cmd == "rehearse":
        return rehearse(args.bundle, args.out)
    if args.cmd == "bundle":
        s = bundle(args.out, args.gguf, args.python_version)
        print((args.out / "PLAN.md").read_text())
        over = over_plan(s)
        sizes = ", ".join(f"{c['bytes'] / MiB:.1f}" for c in s["calls"])
        print(f"gpu-bundle: {len(s['calls'])} calls sending {sizes} MiB "
              f"(plan: {', '.join(f'{x / MiB:.0f}' for x in CALL_PLAN)} MiB; the device takes {CALL_LIMIT / MiB:.0f})"
              + (f"; OVER: {over}" if over else ""))
        return 1 if over else 0
    small = args.small or args.device == "cpu"
    stages = set(args.stages.split(",")) if args.stages else None
    deadline = args.deadline_s if args.deadline_s is not None else (DEADLINE_S if args.device == "cuda" else 0)
    report = check(args.device, args.out, args.tokenizer or default_model_dir(), args.gguf, small, stages, deadline)
    print((args.out / "gpu-check.md").read_text())
    failed = [n for n, s in report.stages.items() if not s["ok"]]
    if failed:
        print(f"gpu-check: failed stages: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
