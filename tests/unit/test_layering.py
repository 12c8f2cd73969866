"""The layers import downwards only, not even inside a function:
- the product (structspec/, and kernels/, worker/ and migrations/, which install inside it) never
  imports the benchmark harness beside it (bench/, not in the wheel): bench imports structspec,
  never the reverse;
- the kernels are the bottom layer: they import nothing of structspec but themselves;
- the engine, the grammar library, the statistics and the database never import the shared
  services (structspec/services), the HTTP API, the CLI or what sits beside it (client, demo,
  the worker);
- the services import none of the application layer above them;
- the worker and the HTTP API sit side by side: the worker imports no part of the API or the CLI
  (what both need, such as a batch's view, lives in structspec/services);
- the grammar library does not import the engine, and the statistics are pure: no database;
- ingestion (bytes to text with page boxes) sits beside them and needs none of them, and the
  engine and the grammar see text only: they never import it;
- nothing imports the old top-level names `kernels` and `worker` (structspec.kernels and
  structspec.worker now), and the harness's modules import each other without a cycle."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HARNESS = ("bench",)
APPLICATION = ("structspec.api", "structspec.cli", "structspec.client", "structspec.demo", "structspec.worker")
BELOW_SERVICES = APPLICATION + ("structspec.services",)
STRUCTSPEC_BUT_KERNELS = tuple(f"structspec.{p.stem if p.is_file() else p.name}"
                               for p in sorted((ROOT / "structspec").iterdir())
                               if p.name != "__pycache__" and (p.suffix == ".py" or (p / "__init__.py").is_file())
                               and p.name != "__init__.py")
FORBIDDEN = {
    "structspec": HARNESS,
    "kernels": HARNESS + STRUCTSPEC_BUT_KERNELS,
    "worker": HARNESS + ("structspec.api", "structspec.cli"),
    "migrations": HARNESS + APPLICATION + ("structspec.services",),
    "structspec/services": APPLICATION,
    "structspec/engine": BELOW_SERVICES + ("structspec.ingest",),
    "structspec/grammar": BELOW_SERVICES + ("structspec.engine", "structspec.ingest"),
    "structspec/ingest": BELOW_SERVICES + ("structspec.engine", "structspec.grammar", "structspec.db",
                                           "structspec.stats"),
    "structspec/stats": BELOW_SERVICES + ("structspec.db", "sqlalchemy"),
    "structspec/db": BELOW_SERVICES,
}
OLD_NAMES = ("kernels", "worker")  # top-level packages no more: structspec.kernels, structspec.worker


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


def test_nothing_imports_the_old_top_level_names():
    found = [v for folder in ("structspec", "kernels", "worker", "migrations", "bench", "tests")
             for v in violations(folder, OLD_NAMES)]
    assert found == []


def test_the_product_never_imports_the_harness(tmp_path):
    pkg = tmp_path / "structspec" / "engine"
    pkg.mkdir(parents=True)
    (pkg / "m.py").write_text("def f():\n    from bench.exactness import compare\n")
    assert violations("structspec", HARNESS, root=tmp_path) == [
        "structspec/engine/m.py:2 imports bench.exactness", "structspec/engine/m.py:2 imports bench.exactness.compare"]


def harness_imports(root: Path = ROOT) -> dict[str, set[str]]:
    """bench's modules (`bench.x`) and the bench modules each imports, at any level."""
    graph: dict[str, set[str]] = {}
    for path in sorted((root / "bench").glob("*.py")):
        name = "bench" if path.stem == "__init__" else f"bench.{path.stem}"
        found = set()
        for _, module in imported_modules(path):
            if not module.startswith("bench."):
                continue
            # `from bench import ocr` names a module; `from bench.ocr import f` names one and a function
            while module != "bench" and not (root / (module.replace(".", "/") + ".py")).is_file():
                module = module.rpartition(".")[0]
            if module != name:
                found.add(module)
        graph[name] = found
    return graph


def cycle(graph: dict[str, set[str]]) -> list[str]:
    """One import cycle of `graph` (its modules in order, the first repeated at the end); [] if none."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str]:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return []

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return []


def test_the_harness_has_no_import_cycle():
    assert cycle(harness_imports()) == []


def test_the_cycle_check_sees_a_function_level_cycle(tmp_path):
    (tmp_path / "bench").mkdir()
    (tmp_path / "bench" / "__init__.py").write_text("")
    (tmp_path / "bench" / "a.py").write_text("from bench.b import g\n")
    (tmp_path / "bench" / "b.py").write_text("def g():\n    from bench import a\n")
    assert cycle(harness_imports(tmp_path)) == ["bench.a", "bench.b", "bench.a"]
