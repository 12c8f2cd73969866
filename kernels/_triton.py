"""Optional Triton import shared by the kernel modules.

The torch references must keep working where ``import triton`` fails (no
wheel for the platform, a broken install, no usable backend).  Kernel modules
therefore import ``triton`` and ``tl`` from here: when the real import fails
they get stand-ins that are good enough for ``@triton.jit`` decorators and
``tl.constexpr`` annotations to evaluate at module import, and that raise a
clear ``RuntimeError`` if a kernel is ever launched.
"""

from __future__ import annotations

import os
from typing import Any

__all__ = [
    "TRITON_IMPORT_ERROR",
    "interpreter_enabled",
    "next_power_of_2",
    "require_triton",
    "tl",
    "triton",
    "triton_available",
]


class _UnavailableKernel:
    """Placeholder for a ``@triton.jit`` function when triton did not import."""

    def __init__(self, fn: Any) -> None:
        self.fn = fn
        self.__name__ = getattr(fn, "__name__", "kernel")

    def _fail(self, *args: Any, **kwargs: Any) -> Any:
        require_triton()

    __call__ = _fail
    __getitem__ = _fail


class _MissingTriton:
    """Stand-in for the ``triton`` module; only ``jit`` is usable."""

    @staticmethod
    def jit(fn: Any = None, **_kwargs: Any) -> Any:
        # Supports both ``@triton.jit`` and ``@triton.jit(do_not_specialize=...)``.
        if fn is None:
            return _UnavailableKernel
        return _UnavailableKernel(fn)

    def __getattr__(self, name: str) -> Any:
        require_triton()


class _MissingLanguage:
    """Stand-in for ``triton.language``; attributes exist only for annotations."""

    constexpr = "constexpr"

    def __getattr__(self, name: str) -> Any:
        return None


try:
    import triton
    import triton.language as tl

    TRITON_IMPORT_ERROR: BaseException | None = None
except Exception as exc:  # ImportError, or a backend that fails while loading
    TRITON_IMPORT_ERROR = exc
    triton = _MissingTriton()  # type: ignore[assignment]
    tl = _MissingLanguage()  # type: ignore[assignment]


def triton_available() -> bool:
    """True when the real ``triton`` package imported successfully."""
    return TRITON_IMPORT_ERROR is None


def require_triton() -> None:
    """Raise ``RuntimeError`` explaining why the Triton backend cannot run."""
    if TRITON_IMPORT_ERROR is not None:
        raise RuntimeError(
            "the Triton backend is unavailable because `import triton` failed: "
            f"{TRITON_IMPORT_ERROR!r}; use backend='torch'"
        ) from TRITON_IMPORT_ERROR


def interpreter_enabled() -> bool:
    """True when TRITON_INTERPRET asks Triton to run kernels on the CPU interpreter."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on", "yes")


def next_power_of_2(n: int) -> int:
    """Smallest power of two >= n (n >= 1); avoids needing triton for block sizes."""
    return 1 << max(int(n) - 1, 0).bit_length()
