"""Ahead-of-time compilation of every kernel (verification and attention) for an NVIDIA GPU,
without one.

The interpreter accepts some code the compiler rejects (and vice versa), so
the kernels are also lowered to a cubin for sm_90 with the ptxas bundled in
the triton wheel.  It runs in a subprocess because this test session has
TRITON_INTERPRET=1 set.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


def test_kernels_compile_for_sm90() -> None:
    if importlib.util.find_spec("triton.backends.nvidia") is None:
        # The pinned triton wheel ships the NVIDIA backend and its ptxas: missing is a broken
        # install, which CI must not pass over (as a missing service fails there, not skips).
        reason = "no NVIDIA backend in the installed triton: the kernels cannot be compiled for a GPU"
        if os.environ.get("CI"):
            pytest.fail(reason)
        pytest.skip(reason)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # silence the 3.9 default-change warning
    result = subprocess.run(
        [sys.executable, str(HERE / "compile_for_gpu.py"), "--logit-dtypes", "bf16", "90"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("cubin") == 4 + 6, result.stdout  # verification kernels, then the attention
