"""The house's import graph: no module of cerar/ or train/ reaches itself again through its imports, and the
library never imports the trainer.

The graph is read from the source (every import statement, at the top of a module or inside a function: an
import deferred into a function still ties the two modules together), so a circle is found before any of its
modules runs. `from cerar import x` counts as importing cerar's package module (its __init__), unless x is a
module of its own.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("cerar", "train")


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(root: Path = ROOT, packages: tuple[str, ...] = PACKAGES) -> dict[str, set[str]]:
    """module -> the modules of `packages` (folders under root) it imports (its own package's __init__ left out:
    Python runs it first whatever the module imports)."""
    paths = {module_name(p, root): p for package in packages for p in (root / package).rglob("*.py")}

    def known(name: str) -> str | None:  # the longest prefix that is one of our modules
        while name and name not in paths:
            name = name.rpartition(".")[0]
        return name or None

    graph = {}
    for module, path in paths.items():
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        targets = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets.update(known(alias.name) for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*parts, *([base] if base else [])])
                for alias in node.names:
                    full = f"{base}.{alias.name}"
                    targets.add(full if full in paths else known(base))
        graph[module] = {t for t in targets if t and t != module and not package.startswith(t)}
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


@pytest.mark.quick
def test_no_module_reaches_itself_through_its_imports():
    assert circles(import_graph()) == []


@pytest.mark.quick
def test_no_study_module_reaches_itself_through_its_imports():
    """scripts/studies too (issue 53: the time-to-loss study's launch and report imported each other)."""
    graph = import_graph(packages=("scripts/studies",))
    assert "scripts.studies.ttl.report" in graph and circles(graph) == []


@pytest.mark.quick
def test_the_library_never_imports_the_trainer():
    graph = import_graph()
    assert {m: sorted(t for t in targets if t.startswith("train")) for m, targets in graph.items()
            if m.startswith("cerar") and any(t.startswith("train") for t in targets)} == {}  # fmt: skip


@pytest.mark.quick
def test_the_reader_sees_a_circle_where_there_is_one(tmp_path):
    """The graph reader itself: a deferred import that closes a circle is found, a one-way import is not."""
    for package in PACKAGES:
        (tmp_path / package).mkdir()
        (tmp_path / package / "__init__.py").write_text("")
    (tmp_path / "cerar" / "a.py").write_text("from cerar.b import f\n")
    (tmp_path / "cerar" / "b.py").write_text("def f():\n    from cerar import a\n")
    (tmp_path / "train" / "c.py").write_text("from cerar.a import f\nfrom . import d\n")
    (tmp_path / "train" / "d.py").write_text("import cerar\n")
    graph = import_graph(tmp_path)
    assert graph["train.c"] == {"cerar.a", "train.d"} and graph["train.d"] == {"cerar"}
    assert circles(graph) == [["cerar.a", "cerar.b"]]
