"""Every C kernel compiles for every x86 CPU family it has code for, not only for this one.

kernels/native.py builds each source with -march=native, so a test run compiles only the
branches of this host's CPU: a break in the AMX or AVX512-BF16 branches passed a whole test run
on an AVX-512 Xeon without them, and every bf16 host then fell back to the torch attention (a
warning in the worker's log). Here each source is compiled (at -O0: the front end and the
intrinsics' target checks, ~1 s a build) for one CPU of each family the sources tell apart.
"""

from __future__ import annotations

import platform
import subprocess

import pytest

from structspec.kernels import cpu_attention, cpu_forward, cpu_layer, cpu_linear, native

# -march: what each selects in the sources
TARGETS = {
    "x86-64-v3": "AVX2 + FMA (Zen 3, Haswell): the 16-register paths",
    "skylake-avx512": "AVX-512F without VNNI or bf16",
    "cascadelake": "AVX-512 with VNNI, no bf16 (fp32 models)",
    "cooperlake": "AVX512-BF16 without AMX (as Zen 4 and Zen 5)",
    "sapphirerapids": "AMX tiles and AVX512-BF16",
}
SOURCES = {
    "cpu_attention d64": (cpu_attention.SOURCE, cpu_attention.FLAGS + ("-DHEAD_DIM=64", "-DVALUE_DIM=64")),
    "cpu_attention d128": (cpu_attention.SOURCE, cpu_attention.FLAGS + ("-DHEAD_DIM=128", "-DVALUE_DIM=128")),
    "cpu_linear": (cpu_linear.SOURCE, cpu_linear.FLAGS),
    "cpu_forward": (cpu_forward.SOURCE, cpu_forward.FLAGS),
    "cpu_layer": (cpu_layer.SOURCE, cpu_layer.FLAGS),
}

pytestmark = pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"),
                                reason="the targets below are x86 CPUs; this host is not one")


def compile_for(source, flags: tuple[str, ...], march: str, out) -> subprocess.CompletedProcess:
    """native.FLAGS with -march=`march` for -march=native and -O0 for -O3, compiled to an object."""
    base = [f"-march={march}" if f == "-march=native" else "-O0" if f == "-O3" else f
            for f in native.FLAGS if f != "-shared"]
    return subprocess.run([native.compiler(), *base, *flags, "-c", str(source), "-o", str(out)],
                          capture_output=True, text=True, timeout=120)


@pytest.mark.long  # this host's own builds are tested in `make test` (tests/kernels/test_cpu_*.py)
@pytest.mark.parametrize("march", list(TARGETS))
@pytest.mark.parametrize("name", list(SOURCES))
def test_each_kernel_source_compiles_for_each_cpu_family(name, march, tmp_path):
    source, flags = SOURCES[name]
    done = compile_for(source, flags, march, tmp_path / "k.o")
    assert done.returncode == 0, f"{source.name} ({' '.join(flags)}) does not compile for -march={march} " \
                                 f"({TARGETS[march]}):\n{done.stderr[-3000:]}"


def test_the_linear_kernel_refuses_a_cpu_without_avx2_saying_so(tmp_path):
    """The one source that needs vector units says which when a build lacks them (native.build's
    RuntimeError carries the message into the engine's log; the torch path runs instead)."""
    done = compile_for(cpu_linear.SOURCE, cpu_linear.FLAGS, "x86-64", tmp_path / "k.o")
    assert done.returncode != 0
    assert "needs AVX-512F, or AVX2 with FMA" in done.stderr
