"""The core's import graph has no cycle: every ``import dpro...`` / ``from dpro... import`` of core/ (the ``dpro``
package without plugins/ and launch/), at module level and inside functions, counted; those under
``if TYPE_CHECKING:`` (type back-references) not. An import inside a function that closes a cycle is a module in the
wrong layer, so it counts like any other."""

from __future__ import annotations

import ast
from pathlib import Path

import networkx as nx

CORE = Path(__file__).resolve().parents[1] / "core"


def core_modules(root: Path = CORE) -> dict[str, Path]:
    """``dpro.<dotted path>`` -> file, for every module under ``root``."""
    out = {}
    for path in root.rglob("*.py"):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(["dpro", *parts])] = path
    return out


def _under_type_checking(tree: ast.AST) -> set[int]:
    skipped: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", getattr(node.test, "attr", None)) == "TYPE_CHECKING":
            skipped.update(id(sub) for sub in ast.walk(node))
    return skipped


def import_graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the core modules it imports (a name imported from a module counts as that module, or as the
    submodule it names)."""

    def resolve(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {}
    for module, path in modules.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        skipped = _under_type_checking(tree)
        targets: set[str] = set()
        for node in ast.walk(tree):
            if id(node) in skipped:
                continue
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    base = ".".join(up + ([base] if base else []))
                names = [base, *(f"{base}.{alias.name}" for alias in node.names)]
            else:
                continue
            for name in names:
                if name.startswith("dpro.") and not name.startswith(("dpro.plugins", "dpro.launch")):
                    target = resolve(name)
                    if target and target != module:
                        targets.add(target)
        graph[module] = targets
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module."""
    g = nx.DiGraph([(a, b) for a, targets in graph.items() for b in targets])
    return sorted(sorted(c) for c in nx.strongly_connected_components(g) if len(c) > 1)


def test_the_cycle_finder_finds_a_cycle_through_a_function_level_import(tmp_path: Path) -> None:
    (tmp_path / "low.py").write_text("def f():\n    from dpro.high import g\n")
    (tmp_path / "high.py").write_text("from dpro.low import f\n")
    (tmp_path / "typed.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                       "    from dpro.high import g\n")
    (tmp_path / "other.py").write_text("from dpro.typed import x\n")
    graph = import_graph(core_modules(tmp_path))
    assert cycles(graph) == [["dpro.high", "dpro.low"]]
    assert graph["dpro.typed"] == set()


def test_the_core_has_no_import_cycle() -> None:
    graph = import_graph(core_modules())
    assert len(graph) > 40
    assert cycles(graph) == []


def test_io_looks_up_no_engine_and_analysis_imports_no_report() -> None:
    """Reading is io's alone (the engine's preparation is ``dpro.engines.prepared``, a layer above), and analysis
    writes no report file (``dpro analyze`` writes ``analysis/replay.json`` from cli.py)."""
    graph = import_graph(core_modules())
    for module, targets in graph.items():
        if module.startswith("dpro.io."):
            assert not any(t.startswith("dpro.engines") for t in targets), (module, targets)
        if module.startswith("dpro.analyze"):
            assert not any(t.startswith("dpro.report") for t in targets), (module, targets)
