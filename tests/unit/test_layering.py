"""The layers import downwards only, not even inside a function:
- the engine, the grammar library, the statistics and the database never import the shared
  services (structspec/services), the HTTP API, the CLI or what sits beside it (client, demo,
  benchmarks, the worker);
- the services import none of the application layer above them;
- the worker and the HTTP API sit side by side: the worker imports no part of the API or the CLI
  (what both need, such as a batch's view, lives in structspec/services);
- the grammar library does not import the engine, and the statistics are pure: no database;
- ingestion (bytes to text with page boxes) sits beside them and needs none of them, and the
  engine and the grammar see text only: they never import it."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
APPLICATION = ("structspec.api", "structspec.cli", "structspec.client", "structspec.demo", "structspec.bench",
               "structspec.worker")
BELOW_SERVICES = APPLICATION + ("structspec.services",)
FORBIDDEN = {
    "structspec/services": APPLICATION,
    "structspec/engine": BELOW_SERVICES + ("structspec.ingest",),
    "structspec/grammar": BELOW_SERVICES + ("structspec.engine", "structspec.ingest"),
    "structspec/ingest": BELOW_SERVICES + ("structspec.engine", "structspec.grammar", "structspec.db",
                                           "structspec.stats"),
    "structspec/stats": BELOW_SERVICES + ("structspec.db", "sqlalchemy"),
    "structspec/db": BELOW_SERVICES,
    "worker": ("structspec.api", "structspec.cli"),
}


def imported_modules(path: Path) -> list[tuple[int, str]]:
    out = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.append((node.lineno, node.module))
            out += [(node.lineno, f"{node.module}.{alias.name}") for alias in node.names]
    return out


def violations(package: str, forbidden: tuple[str, ...], root: Path = ROOT) -> list[str]:
    found = []
    for path in sorted((root / package).rglob("*.py")):
        for line, module in imported_modules(path):
            if any(module == f or module.startswith(f + ".") for f in forbidden):
                found.append(f"{path.relative_to(root)}:{line} imports {module}")
    return found


def test_lower_layers_never_import_higher_ones():
    found = [v for package, forbidden in FORBIDDEN.items() for v in violations(package, forbidden)]
    assert found == []


def test_the_check_sees_function_level_imports(tmp_path):
    pkg = tmp_path / "structspec" / "db"
    pkg.mkdir(parents=True)
    (pkg / "m.py").write_text("def f():\n    from structspec.api.services import jobs\n    import structspec.worker.tasks\n")
    assert violations("structspec/db", APPLICATION, root=tmp_path) == [
        "structspec/db/m.py:2 imports structspec.api.services", "structspec/db/m.py:2 imports structspec.api.services.jobs",
        "structspec/db/m.py:3 imports structspec.worker.tasks"]
