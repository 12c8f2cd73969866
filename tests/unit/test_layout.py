"""structspec/layout.py: a checkout's kernels/ and worker/ import as structspec.kernels and
structspec.worker, from the same checkout as structspec itself, with or without an install; the
shipped data is found in a checkout's top-level folders or in an installed package's _data/.
(The wheel itself: tests/integration/test_wheel.py.)"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import structspec.worker
from structspec import layout

ROOT = Path(__file__).resolve().parents[2]
PROBE = ("import json, structspec.worker.watchdog as w; from structspec import layout; "
         "print(json.dumps({'worker': w.__file__, 'checkout': str(layout.checkout()), "
         "'schemas': str(layout.data_dir('schemas'))}))")


def probe(path: Path, cwd: Path) -> subprocess.CompletedProcess:
    """PROBE in a bare interpreter (-S: no site-packages, so no editable install's finder) with
    only `path` on its sys.path, as the GPU kit runs the working tree."""
    return subprocess.run([sys.executable, "-S", "-c", PROBE], cwd=cwd, capture_output=True, text=True, timeout=60,
                          env={"PYTHONPATH": str(path), "PATH": "/usr/bin:/bin"})


def test_a_checkout_imports_its_own_kernels_and_worker_and_finds_its_data():
    from structspec import kernels

    assert layout.checkout() == ROOT
    assert Path(kernels.__file__) == ROOT / "kernels" / "__init__.py"
    assert Path(structspec.worker.__file__) == ROOT / "worker" / "__init__.py"
    assert {name: layout.data_dir(name) for name in layout.DATA} == {name: ROOT / name for name in layout.DATA}
    with pytest.raises(ValueError, match="no shipped data 'bench'"):
        layout.data_dir("bench")


def test_a_checkout_on_sys_path_alone_needs_no_install(tmp_path):
    done = probe(ROOT, tmp_path)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == {"worker": str(ROOT / "worker" / "watchdog.py"), "checkout": str(ROOT),
                                       "schemas": str(ROOT / "schemas")}


def test_an_installed_package_finds_its_data_inside_itself_and_claims_no_checkout(tmp_path):
    """The wheel's layout: structspec/ with kernels/ and worker/ inside, the data in _data/, and
    no pyproject.toml of structspec's beside it (another project's there changes nothing)."""
    site = tmp_path / "site"
    shutil.copytree(ROOT / "structspec", site / "structspec", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(ROOT / "worker", site / "structspec" / "worker", ignore=shutil.ignore_patterns("__pycache__"))
    (site / "pyproject.toml").write_text('[project]\nname = "another"\n')
    (site / "worker").mkdir()
    (site / "worker" / "__init__.py").write_text("raise ImportError('a generic top-level worker package')\n")
    (site / "kernels").mkdir()
    (site / "kernels" / "__init__.py").write_text("")
    done = probe(site, tmp_path)
    assert done.returncode != 0 and "structspec's schemas/ is missing" in done.stderr, done.stderr
    shutil.copytree(ROOT / "schemas", site / "structspec" / "_data" / "schemas")
    done = probe(site, tmp_path)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == {"worker": str(site / "structspec" / "worker" / "watchdog.py"),
                                       "checkout": "None", "schemas": str(site / "structspec" / "_data" / "schemas")}
