"""Test setup for the kernels package.

Triton decides at ``@triton.jit`` decoration time whether a kernel is compiled
or interpreted, so TRITON_INTERPRET must be set before any kernel module is
imported.  That makes ``pytest tests/kernels`` work on a CPU-only machine
without exporting the variable by hand.

With STRUCTSPEC_KERNEL_TESTS=cuda the kernels are compiled instead: the GPU kit runs the
tests whose inputs go to kernel_cases.DEVICE (bitmask, greedy, sampling, attention) that way on
a lent GPU.
"""

from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path

import pytest

ON_CUDA = os.environ.get("STRUCTSPEC_KERNEL_TESTS") == "cuda"
if not ON_CUDA:
    os.environ["TRITON_INTERPRET"] = "1"

_ROOT = Path(__file__).resolve().parents[2]
_HERE = Path(__file__).resolve().parent
# The project may not be pip-installed; make `import structspec` (and with it structspec.kernels,
# structspec/layout.py) resolve to this checkout, and the helpers next to this file importable by name.
for _path in (str(_ROOT), str(_HERE)):
    if _path not in sys.path:
        sys.path.insert(0, _path)

# If something imported the kernel modules before this conftest ran (e.g. a
# test collected earlier in the same session), their kernels were decorated
# for compilation; re-import them, dependencies first, so they interpret.
for _name in ("structspec.kernels.bitmask", "structspec.kernels.greedy", "structspec.kernels.sampling",
              "structspec.kernels.attention"):
    if _name in sys.modules:
        importlib.reload(sys.modules[_name])


@pytest.fixture(scope="session")
def shared_cache(tmp_path_factory) -> Path:
    """A cache directory for the tests that use the C kernels without testing where or whether
    they build: each kernel is compiled once per run (seconds of the compiler each), not once per
    test. An Engine takes it as its cache_dir (the kernels land in its kernels/); a test of the
    build itself (where it lands, a failing compiler) keeps a directory of its own."""
    return tmp_path_factory.mktemp("shared-cache")
