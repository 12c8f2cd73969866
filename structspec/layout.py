"""Where the package's parts are: in an installed wheel, and in a checkout.

The repository keeps parts of the package in top-level folders, which pyproject.toml maps into
it: kernels/ is structspec.kernels, worker/ is structspec.worker (a generic top-level `kernels`
would collide with a PyPI package of that name), and migrations/, schemas/ and examples/ ship as
data, under structspec/_data/ in a wheel. `data_dir` finds the data in either place.

A checkout also runs without an install of its own: put on sys.path (PYTHONPATH, as the GPU kit
runs it), or imported from a worktree whose virtual environment holds an editable install of
another checkout. `install_checkout_finder` (run by the package's __init__) then imports the two
subpackages from the folders beside this package, the same checkout as structspec itself,
never from wherever an editable install points. In a wheel it does nothing.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import importlib.util
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent
SUBPACKAGES = {"structspec.kernels": "kernels", "structspec.worker": "worker"}  # name -> checkout folder
DATA = ("migrations", "schemas", "examples")


@functools.cache
def checkout() -> Path | None:
    """The repository this package was imported from; None where it runs installed (a wheel:
    site-packages holds no pyproject.toml of structspec's, whatever else lies beside it)."""
    root = PACKAGE.parent
    try:
        project = (root / "pyproject.toml").read_text(encoding="utf-8")
    except OSError:
        return None
    ours = '\nname = "structspec"\n' in project
    return root if ours and all((root / f / "__init__.py").is_file() for f in SUBPACKAGES.values()) else None


def data_dir(name: str) -> Path:
    """The folder of shipped data `name` (one of DATA): structspec/_data/<name> in a wheel, the
    repository's top-level <name>/ in a checkout. FileNotFoundError saying where it looked."""
    if name not in DATA:
        raise ValueError(f"no shipped data {name!r}; there are {', '.join(DATA)}")
    shipped = PACKAGE / "_data" / name
    if shipped.is_dir():
        return shipped
    root = checkout()
    if root is not None and (root / name).is_dir():
        return root / name
    raise FileNotFoundError(f"structspec's {name}/ is missing: neither {shipped} (an installed wheel) "
                            f"nor a checkout's {PACKAGE.parent / name}")


class CheckoutFinder(importlib.abc.MetaPathFinder):
    """Finds structspec.kernels and structspec.worker in a checkout's top-level folders (their
    submodules are then found through the package's __path__ as usual)."""

    def __init__(self, root: Path):
        self.root = root

    def find_spec(self, fullname: str, path=None, target=None) -> importlib.machinery.ModuleSpec | None:
        folder = SUBPACKAGES.get(fullname)
        if folder is None:
            return None
        init = self.root / folder / "__init__.py"
        return importlib.util.spec_from_file_location(fullname, init, submodule_search_locations=[str(init.parent)])


def install_checkout_finder() -> None:
    """Put a CheckoutFinder first on sys.meta_path when this package runs from a checkout (once)."""
    root = checkout()
    if root is not None and not any(isinstance(f, CheckoutFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, CheckoutFinder(root))
