"""The wheel as a user gets it: built from this checkout, installed into a fresh virtual
environment, run from a folder outside the checkout.

The fresh environment is not the checkout's: it has no --system-site-packages, and its
site-packages holds the wheel alone (installed with --no-deps) and a .pth line naming the
running environment's site-packages, so the dependencies import from there without an install
(minutes, and a network). A plain path line in a .pth does not run that folder's own .pth
files, so the checkout's editable install there stays out: `structspec` imports from the wheel,
which each test checks first.

What the wheel must hold: the product's modules (kernels/ and worker/ as structspec.kernels and
structspec.worker, no generic top-level name), the C kernels' sources, the migrations, the
schemas and the examples; never the harness (bench/). What it must do: `structspec extract`
with the default model, the C kernels built from the installed sources into the user's cache
(not site-packages) and used, and `structspec migrate` on a fresh database. A missing
prerequisite (setuptools, a C compiler, the default model) fails under CI and skips elsewhere.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import site
import sqlite3
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import jsonschema
import pytest

from tests.conftest import unavailable

pytestmark = [pytest.mark.slow, pytest.mark.model, pytest.mark.long]

ROOT = Path(__file__).resolve().parents[2]
# what a build of the checkout needs; the rest (environments, outputs, caches) is not copied
NOT_COPIED = shutil.ignore_patterns(".git", ".venv*", "build", "dist", "*.egg-info", "__pycache__", ".pytest_cache",
                                    "bench-out", ".gpu", ".gpu-rehearse", "demo-out", ".data", ".cache", "*.so")
FALLBACK_WARNINGS = ("unavailable", "failed the check", "failed its check", "using the torch attention",
                     "cannot run batched")  # engine/runner.py, engine/step.py: a C kernel not used, and why


def run(args: list, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([str(a) for a in args], capture_output=True, text=True, **kwargs)


def user_env(tmp: Path, **extra: str) -> dict[str, str]:
    """The environment of a user's shell: none of the checkout's paths or test settings, the data
    and the caches in `tmp`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("STRUCTSPEC_")
           and k not in ("PYTHONPATH", "PYTHONHOME", "PYTHONSAFEPATH", "TRITON_INTERPRET", "VIRTUAL_ENV")}
    env.update(HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", STRUCTSPEC_DATA_DIR=str(tmp / "data"), **extra)
    return env


def copy_checkout(dest: Path) -> Path:
    """The checkout's files in `dest` (an in-tree build writes build/ and *.egg-info beside them)."""
    shutil.copytree(ROOT, dest, ignore=NOT_COPIED, symlinks=True)
    return dest


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """structspec's wheel, built from a copy of this checkout without build isolation (offline)."""
    import importlib.util

    if importlib.util.find_spec("setuptools") is None:
        unavailable("setuptools is not installed in this environment (pip wheel --no-build-isolation needs it)")
    tmp = tmp_path_factory.mktemp("wheel")
    source = copy_checkout(tmp / "src")
    built = run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-cache-dir",
                 "--wheel-dir", tmp / "out", source], timeout=600)
    assert built.returncode == 0, built.stdout[-3000:] + built.stderr[-3000:]
    [path] = (tmp / "out").glob("structspec-*.whl")
    return path


def fresh_venv(path: Path) -> tuple[Path, Path]:
    """(python, site-packages) of a new virtual environment whose imports fall back to this
    environment's site-packages (a .pth of plain path lines)."""
    made = run([sys.executable, "-m", "venv", "--without-pip", path], timeout=300)
    assert made.returncode == 0, made.stderr
    python = path / "bin" / "python"
    paths = run([python, "-c", "import json, sysconfig; p = sysconfig.get_paths(); "
                               "print(json.dumps(sorted({p['purelib'], p['platlib']})))"], timeout=60)
    sites = [Path(p) for p in json.loads(paths.stdout)]
    # this environment's site-packages, wherever it is (.venv may sit inside the checkout): plain
    # path lines, so its .pth files (the editable install's finder) do not run in the new one
    ours = [p for p in {*site.getsitepackages(), sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
            if Path(p).is_dir() and not (Path(p) / "structspec").exists()]
    sites[0].mkdir(parents=True, exist_ok=True)
    (sites[0] / "zz_structspec_test_dependencies.pth").write_text("".join(f"{p}\n" for p in sorted(ours)))
    return python, sites[0]


def pip_install(python: Path, *args) -> None:
    done = run([sys.executable, "-m", "pip", "--python", python, "install", "--no-deps", "--no-index",
                "--no-cache-dir", "--quiet", *args], timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]


def where(python: Path, cwd: Path, env: dict[str, str]) -> dict[str, str]:
    """Where the given interpreter imports structspec and its parts from, and the data it finds."""
    code = ("import json, structspec, structspec.kernels, structspec.worker, structspec.kernels.native as n; "
            "from structspec.layout import checkout, data_dir; "
            "print(json.dumps({'structspec': structspec.__file__, 'kernels': structspec.kernels.__file__, "
            "'worker': structspec.worker.__file__, 'checkout': str(checkout()), "
            "**{d: str(data_dir(d)) for d in ('migrations', 'schemas', 'examples')}}))")
    done = run([python, "-c", code], cwd=cwd, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


@pytest.fixture(scope="module")
def installed(wheel, tmp_path_factory) -> tuple[Path, Path]:
    """(python, site-packages) of a fresh environment with the wheel installed."""
    python, packages = fresh_venv(tmp_path_factory.mktemp("venv") / "env")
    pip_install(python, wheel)
    return python, packages


def test_the_wheel_holds_the_product_and_its_data_under_its_own_name_and_no_harness(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    tops = {n.split("/")[0] for n in names}
    assert tops == {"structspec", f"{wheel.name.split('-')[0]}-{wheel.name.split('-')[1]}.dist-info"}, tops
    top_level = next((n for n in names if n.endswith(".dist-info/top_level.txt")), None)
    if top_level is not None:
        assert zipfile.ZipFile(wheel).read(top_level).decode().split() == ["structspec"]
    assert not [n for n in names if n.startswith(("bench/", "structspec/bench/", "kernels/", "worker/"))]
    assert "structspec/kernels/bench.py" not in names and not [n for n in names if "cpu_peak" in n]

    def shipped(folder: str, into: str, pattern: str) -> list[str]:
        return sorted(f"{into}/{p.relative_to(ROOT / folder).as_posix()}" for p in (ROOT / folder).glob(pattern)
                      if "__pycache__" not in p.parts)

    # every module of the checkout's package: the explicit package list in pyproject.toml misses none
    expected = (shipped("structspec", "structspec", "**/*.py") + shipped("kernels", "structspec/kernels", "*.py")
                + shipped("worker", "structspec/worker", "*.py"))
    # the C kernels' sources, the migrations, schemas and examples
    expected += shipped("kernels", "structspec/kernels", "*.c") + shipped("kernels", "structspec/kernels", "*.h")
    expected += shipped("migrations", "structspec/_data/migrations", "**/*.py")
    expected += ["structspec/_data/migrations/script.py.mako"]
    expected += shipped("schemas", "structspec/_data/schemas", "*.json")
    expected += shipped("examples", "structspec/_data/examples", "*")
    assert len(expected) > 100 and [n for n in expected if n not in names] == []
    assert "structspec/kernels/cpu_attention.c" in names and "structspec/_data/schemas/contact.json" in names


def test_an_installed_wheel_extracts_outside_the_checkout_with_c_kernels_built_from_its_sources(installed,
                                                                                                tmp_path):
    from structspec.config import Settings
    from structspec.engine.model_files import ModelLoadError, default_gguf_path
    from structspec.kernels import native

    try:
        default_gguf_path()
    except ModelLoadError as e:
        unavailable(f"default model: {e}")
    try:
        native.compiler()
    except RuntimeError as e:
        unavailable(f"the C kernels cannot build here: {e}")
    python, packages = installed
    # a cache of its own, so the kernels are built now, from the installed sources; the default
    # model's conversion (seconds to a minute) is shared with this environment's cache
    cache = tmp_path / "cache"
    cache.mkdir()
    models = Settings.from_env().cache_dir / "models"
    models.mkdir(parents=True, exist_ok=True)
    (cache / "models").symlink_to(models, target_is_directory=True)
    away = tmp_path / "elsewhere"
    away.mkdir()
    env = user_env(tmp_path, STRUCTSPEC_CACHE_DIR=str(cache))

    found = where(python, away, env)
    for name in ("structspec", "kernels", "worker", "migrations", "schemas", "examples"):
        assert Path(found[name]).is_relative_to(packages / "structspec"), (name, found)
    assert found["checkout"] == "None"
    schema_path = Path(found["schemas"]) / "contact.json"
    document = Path(found["examples"]) / "contact-tideway.txt"

    done = run([python.parent / "structspec", "extract", "--schema", schema_path, document, "--stats"],
               cwd=away, env=env, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    jsonschema.validate(json.loads(done.stdout), json.loads(schema_path.read_text()))
    lines = done.stderr.splitlines()
    engine = next(json.loads(line)["engine"] for line in lines if line.startswith('{"engine"'))
    # the C kernels, each used: attention (cpu_attention.c), verification and the lean forward's
    # fused steps (cpu_layer.c); a build or check that failed would show "torch" and a warning
    assert (engine["attention"], engine["verification"], engine["layer_steps"]) == ("native", "native", "fused"), engine
    assert not [line for line in lines if any(w in line for w in FALLBACK_WARNINGS)], done.stderr[-4000:]
    built = {re.match(r"(cpu_[a-z]+)_", p.name).group(1) for p in (cache / "kernels").glob("cpu_*.so")}
    assert {"cpu_attention", "cpu_layer"} <= built, built  # into the user's cache ...
    assert list((packages / "structspec").rglob("*.so")) == []  # ... never into site-packages


def test_an_installed_wheel_migrates_a_fresh_database_to_the_checkouts_head(installed, tmp_path):
    python, packages = installed
    database = tmp_path / "fresh.db"
    env = user_env(tmp_path, STRUCTSPEC_DATABASE_URL=f"sqlite:///{database}")
    # `structspec serve` runs this step before it serves (cli.cmd_serve), from the installed package
    done = run([python.parent / "structspec", "migrate"], cwd=tmp_path, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    heads = sorted(re.match(r"(\d+)_", p.name).group(1) for p in (ROOT / "migrations" / "versions").glob("*.py"))
    with sqlite3.connect(database) as conn:
        assert conn.execute("select version_num from alembic_version").fetchall() == [(heads[-1],)]
        tables = {r[0] for r in conn.execute("select name from sqlite_master where type = 'table'")}
    assert {"schemas", "jobs", "batches"} <= tables, tables
    current = run([python.parent / "structspec", "migrate", "current"], cwd=tmp_path, env=env, timeout=300)
    assert current.returncode == 0, current.stderr[-4000:]
    assert f"is at revision {heads[-1]} (head {heads[-1]})" in current.stderr, current.stderr


def test_an_editable_install_maps_kernels_and_worker_into_the_package(tmp_path):
    """What `make install` does (pip install -e): the package-dir mappings resolve from anywhere."""
    import importlib.util

    if importlib.util.find_spec("setuptools") is None:
        unavailable("setuptools is not installed in this environment (pip install -e needs it)")
    source = copy_checkout(tmp_path / "src")
    python, _ = fresh_venv(tmp_path / "env")
    done = run([sys.executable, "-m", "pip", "--python", python, "install", "--no-deps", "--no-build-isolation",
                "--no-index", "--no-cache-dir", "--quiet", "-e", source], timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    away = tmp_path / "elsewhere"
    away.mkdir()
    found = where(python, away, user_env(tmp_path))
    assert Path(found["structspec"]) == source / "structspec" / "__init__.py"
    assert Path(found["kernels"]) == source / "kernels" / "__init__.py"
    assert Path(found["worker"]) == source / "worker" / "__init__.py"
    assert {Path(found[d]) for d in ("migrations", "schemas", "examples")} == {source / d for d in
                                                                               ("migrations", "schemas", "examples")}
