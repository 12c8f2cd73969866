"""Building this project's C kernels (kernels/*.c) for the CPU they run on.

Each is compiled at first use by the system's C compiler (``$CC``, else ``cc``) with
``-O3 -march=native`` and OpenMP into a cache directory, under a name keyed by the source, the
flags, the CPU's feature flags and the compiler (the source read with the local headers it
includes, ``#include "cpu_amx.h"``), so a changed source or header or another CPU builds
anew and a worker beside this one never loads half a file (the build lands by an atomic
rename). OpenMP is linked by soname, so the library shares the libgomp torch already loaded
(one thread pool). ``build`` raises ``RuntimeError`` saying why when there is no compiler or
the build fails; callers keep their torch path then. ``load`` builds and wraps a library once
per process (each kernels/cpu_*.py's own ``load`` goes through it).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import re
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

_LOCK = threading.Lock()
_LOADED: dict[tuple[str, tuple[str, ...], str], object] = {}

HEADERS = Path(__file__).parent  # where the kernels' shared headers are (cpu_amx.h)
FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-fno-math-errno", "-fno-trapping-math")


def cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


def compiler() -> str:
    cc = os.environ.get("CC") or "cc"
    path = shutil.which(cc)
    if path is None:
        raise RuntimeError(f"no C compiler ({cc!r} not found; set CC)")
    return path


def cache_dir(given: Path | str | None = None) -> Path:
    """`given`, else $XDG_CACHE_HOME/structspec/kernels (~/.cache when unset)."""
    if given is not None:
        return Path(given)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "structspec" / "kernels"


def build(source: Path, flags: tuple[str, ...], cache: Path | str | None = None) -> Path:
    """The shared library of `source` built with FLAGS + `flags` under `cache` (built if absent)."""
    cc = compiler()
    directory = cache_dir(cache)
    text = source_text(source)
    all_flags = FLAGS + tuple(flags)
    key = hashlib.sha256(b"\0".join([text, " ".join(all_flags).encode(), cpu_flags().encode(),
                                     platform.machine().encode(), cc.encode()])).hexdigest()[:16]
    suffix = "_".join(f.split("=", 1)[1] for f in flags if f.startswith("-D") and "=" in f)
    target = directory / f"{source.stem}{'_' + suffix if suffix else ''}_{key}.so"
    if target.exists():
        return target
    directory.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=directory)
    os.close(fd)
    try:
        done = subprocess.run([cc, *all_flags, f"-I{HEADERS}", str(source), "-o", tmp], capture_output=True,
                              text=True, timeout=120)
        if done.returncode != 0:
            raise RuntimeError(f"{Path(cc).name} failed on {source.name}: {done.stderr.strip()[-400:]}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def source_text(source: Path) -> bytes:
    """`source`'s bytes followed by those of each local header it includes (``#include "name"``,
    read beside it, else from this directory: a copy of a kernel built elsewhere still finds its
    headers, as the compiler does through ``-I``), for the build key."""
    text = source.read_bytes()
    headers = re.findall(rb'^[ \t]*#[ \t]*include[ \t]+"([^"]+)"', text, re.MULTILINE)
    found = (next((p for p in (source.parent / n.decode(), HEADERS / n.decode()) if p.exists()), None)
             for n in headers)
    return b"\0".join([text, *(p.read_bytes() for p in found if p is not None)])


def open_library(path: Path, source: Path, version: str, expected: int) -> ctypes.CDLL:
    """The library at `path` (built from `source`), refused with RuntimeError unless its
    function `version` returns `expected` (the version its Python wrapper speaks)."""
    lib = ctypes.CDLL(str(path))
    if getattr(lib, version)() != expected:
        raise RuntimeError(f"{path} is another version of {source.name}")
    return lib


def address(fn) -> int:
    """The address of a loaded library's function (a ctypes function pointer), for C code that
    calls it (kernels/cpu_forward.c)."""
    return ctypes.cast(fn, ctypes.c_void_p).value


def load(source: Path, flags: tuple[str, ...], cache: Path | str | None, wrap):
    """`wrap(path)` of `source`'s library built with FLAGS + `flags` under `cache` (see
    cache_dir), built and wrapped once per process for each (source, flags, cache); RuntimeError
    from build says why not."""
    directory = cache_dir(cache)
    key = (str(source), tuple(flags), str(directory))
    with _LOCK:
        if key not in _LOADED:
            _LOADED[key] = wrap(build(source, flags, directory))
        return _LOADED[key]
