"""Imports run one way: no package of the course imports itself back through its own modules.

The graph is read from the source (the `ast` of every module), not from running it, so an import
inside a function counts as much as one at the top of a file: a cycle through a function-level
import is the same tangle, only hidden until that function runs. Each edge says which kind it is,
so a failure names where to cut.
"""
from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(node: ast.AST, module: str, is_package: bool, known: set[str]) -> list[str]:
    """The modules of `known` that one import statement names (`from a import b` names a.b when
    a.b is a module, else a)."""
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    else:
        base = node.module or ""
        if node.level:
            package = module.split(".") if is_package else module.split(".")[:-1]
            package = package[:len(package) - node.level + 1]
            base = ".".join(package + ([base] if base else []))
        names = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base
                 for alias in node.names]
    found = []
    for name in names:
        while name and name not in known:  # `import a.b.c` names a.b.c, else its package
            name = name.rpartition(".")[0]
        if name and name != module:
            found.append(name)
    return found


def import_graph(packages: list[str], root: Path = REPO) -> dict[str, dict[str, str]]:
    """{module: {imported module: "module level" | "in a function"}} for every module of the
    packages (folders under `root`), counting only imports among them."""
    files = {module_name(p, root): p for package in packages
             for p in (root / package).rglob("*.py")}
    known = set(files)
    graph: dict[str, dict[str, str]] = {}
    for module, path in files.items():
        edges = graph.setdefault(module, {})
        tree = ast.parse(path.read_text(), str(path))
        top_level = {id(n) for n in tree.body}
        for node in ast.walk(tree):
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            kind = "module level" if id(node) in top_level else "in a function"
            for target in imported_modules(node, module, path.name == "__init__.py", known):
                if edges.get(target) != "module level":
                    edges[target] = kind
    return graph


def import_cycles(packages: list[str], root: Path = REPO) -> list[list[str]]:
    """Every strongly connected group of more than one module (Tarjan's algorithm), sorted; an
    empty list when imports run one way."""
    graph = import_graph(packages, root)
    index, low, stack, on_stack, groups = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return groups


def describe(group: list[str], graph: dict[str, dict[str, str]]) -> str:
    members = set(group)
    edges = [f"{a} -> {b} ({kind})" for a in group for b, kind in sorted(graph[a].items())
             if b in members]
    return "; ".join(edges)


def test_the_graph_sees_both_kinds_of_import():
    graph = import_graph(["grading"])
    assert graph["grading.cli"]["grading.runner"] == "module level"
    assert graph["grading.runner"]["grading.kernel_audit"] == "in a function"
    assert graph["grading.labs.lab01_elementwise_add"]["grading.spec"] == "module level"


def test_a_cycle_is_found(tmp_path):
    package = tmp_path / "tangle"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("from tangle import b\n")
    (package / "b.py").write_text("def f():\n    from . import a\n")
    (package / "c.py").write_text("import tangle.a\n")  # imports into the cycle, not part of it
    assert import_cycles(["tangle"], tmp_path) == [["tangle.a", "tangle.b"]]


def test_imports_run_one_way():
    packages = ["grading", "kernels"]
    graph = import_graph(packages)
    cycles = import_cycles(packages)
    assert not cycles, "import cycles: " + " | ".join(describe(g, graph) for g in cycles)
