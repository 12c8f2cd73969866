"""The chip's arithmetic peak (bench/cpu_peak.c), as bench.bound measures it: every
unit this CPU has is measured, none it lacks is claimed, and each dtype is set against its
fastest unit. (How fast is a benchmark's business, never a test's: docs/benchmarks.md.)"""

from __future__ import annotations

import pytest
import torch

from bench import bound
from structspec.kernels import native

FLAGS = set(native.cpu_flags().split())
HAS_DPBF16 = "avx512_bf16" in FLAGS
HAS_AMX = HAS_DPBF16 and {"amx_tile", "amx_bf16"} <= FLAGS


def test_each_unit_the_cpu_has_is_measured_and_none_it_lacks():
    peaks = bound.peak_gflops(seconds=0.02, repeats=1)
    assert set(peaks) == set(bound.PEAK_KINDS)
    assert peaks["fp32 FMA"] and peaks["fp32 FMA"] > 0, peaks  # every CPU the kernels build for has FMA
    assert (peaks["bf16 vdpbf16ps"] is not None) == HAS_DPBF16, (peaks, HAS_DPBF16)
    assert (peaks["bf16 AMX"] is not None) == HAS_AMX, (peaks, HAS_AMX)
    for name, rate in peaks.items():
        assert rate is None or rate > 0, (name, rate)
    assert set(bound.peak_gflops(seconds=0.02, repeats=1, names=bound.DTYPE_UNITS[torch.float32])) == {"fp32 FMA"}


def test_the_avx2_build_measures_fp32_only(tmp_path):
    """A build without AVX-512 (as on an AVX2 CPU): its fp32 chains are 256-bit FMAs, bf16 absent."""
    import ctypes

    source = bound.PEAK_SOURCE
    lib = ctypes.CDLL(str(native.build(source, ("-mno-avx512f",), tmp_path)))
    lib.structspec_peak_gflops.restype = ctypes.c_double
    lib.structspec_peak_gflops.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int]
    assert lib.structspec_peak_gflops(0, 1 << 14, 2) > 0
    assert lib.structspec_peak_gflops(1, 1 << 14, 2) == 0 and lib.structspec_peak_gflops(2, 1 << 14, 2) == 0
    assert lib.structspec_peak_gflops(7, 1 << 14, 2) == 0  # no such kind


def test_a_dtype_is_set_against_its_fastest_unit_and_none_without_one():
    peaks = {"fp32 FMA": 500.0, "bf16 vdpbf16ps": 1000.0, "bf16 AMX": 4000.0}
    assert bound.dtype_peak(peaks, torch.bfloat16) == 4000.0
    assert bound.dtype_peak({**peaks, "bf16 AMX": None}, torch.bfloat16) == 1000.0
    assert bound.dtype_peak(peaks, torch.float32) == 500.0
    assert bound.dtype_peak(dict.fromkeys(peaks), torch.bfloat16) is None


def test_without_a_compiler_nothing_is_claimed(monkeypatch):
    def refuse(*args, **kwargs):
        raise RuntimeError("no C compiler ('nope' not found; set CC)")

    monkeypatch.setattr(native, "load", refuse)
    assert bound.peak_gflops() == dict.fromkeys(bound.PEAK_KINDS)
    assert bound.limits(torch.float32)["peak_gflops"] is None
