"""The modules of ``mpk`` import each other without a cycle.

A cycle between modules works only while every module of it reads the others' names late
(inside functions) and breaks, with a partially initialized module, as soon as one of them
is imported first from somewhere new; so none is allowed, also not through imports inside
functions. The graph is read from the source (``ast``), not by importing it:

- ``import a.b`` and ``from a import b`` where ``a.b`` is a module: an edge to ``a.b``;
- ``from a import name`` where ``name`` is not a module: an edge to ``a`` (its ``__init__``
  must define ``name``); relative imports are resolved against the importing module;
- imports at module level, in functions and classes, in ``try`` and ``if`` blocks all count,
  except those under ``if TYPE_CHECKING:`` (never run);
- the import of a module's parent packages that Python performs first is not an edge: it
  reads no name of theirs, so a package ``__init__`` that imports its submodules is no cycle.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = "mpk"


def module_files(root: Path = ROOT, package: str = PACKAGE) -> dict[str, Path]:
    """Every module of ``package`` under ``root``: dotted name → file."""
    found = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.AST):
    """The import statements of a module, anywhere in it but under ``if TYPE_CHECKING:``."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif isinstance(node, ast.If) and _is_type_checking(node.test):
            stack.extend(node.orelse)  # the else branch runs
        else:
            stack.extend(ast.iter_child_nodes(node))


def import_graph(modules: dict[str, Path]) -> dict[str, dict[str, int]]:
    """module → {imported module of the same package → line of the (first) import}."""
    graph: dict[str, dict[str, int]] = {}
    for name, path in modules.items():
        is_package = path.name == "__init__.py"
        edges: dict[str, int] = {}
        for node in _imports(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                if node.level:
                    base = name.split(".") if is_package else name.split(".")[:-1]
                    base = base[:len(base) - (node.level - 1)]
                    source = ".".join(base + ([node.module] if node.module else []))
                else:
                    source = node.module or ""
                targets = []
                for alias in node.names:
                    sub = f"{source}.{alias.name}"
                    targets.append(sub if sub in modules else source)
            for target in targets:
                if target in modules and target != name:
                    edges.setdefault(target, node.lineno)
        graph[name] = edges
    return graph


def find_cycle(graph: dict[str, dict[str, int]]) -> list[str] | None:
    """One cycle of the graph as [a, b, ..., a], or None."""
    state: dict[str, int] = {}  # 1 on the current path, 2 done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, {})):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def describe(cycle: list[str], graph: dict[str, dict[str, int]], modules: dict[str, Path]) -> str:
    return "\n".join(f"  {a} ({modules[a].relative_to(ROOT)}:{graph[a][b]}) imports {b}"
                     for a, b in zip(cycle, cycle[1:]))


def test_mpk_has_no_import_cycle():
    modules = module_files()
    assert "mpk.backend" in modules and "mpk.executors.build" in modules
    graph = import_graph(modules)
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle:\n" + describe(cycle, graph, modules)


def test_the_graph_reader_sees_every_kind_of_import(tmp_path):
    """Relative, function-level, try-block and from-package imports are edges;
    TYPE_CHECKING-only imports and the implicit import of parent packages are not."""
    pkg = tmp_path / "p"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("from p.a import f\n")
    (pkg / "a.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from p import b\n"
                              "def f():\n    from .sub import c\n")
    (pkg / "b.py").write_text("try:\n    import p.a as a\nexcept ImportError:\n    pass\n")
    (pkg / "sub" / "__init__.py").write_text("from .. import e\n")
    (pkg / "e.py").write_text("")
    (pkg / "sub" / "c.py").write_text("from . import X\nfrom p.sub import c\n")
    modules = module_files(tmp_path, "p")
    graph = import_graph(modules)
    assert {k: set(v) for k, v in graph.items()} == {
        "p": {"p.a"}, "p.a": {"p.sub.c"}, "p.b": {"p.a"}, "p.e": set(), "p.sub": {"p.e"},
        "p.sub.c": {"p.sub"}}
    assert find_cycle(graph) is None
    (pkg / "e.py").write_text("def g():\n    from p.b import a\n")  # a name of p.b, not a module
    graph = import_graph(module_files(tmp_path, "p"))
    assert find_cycle(graph) == ["p.a", "p.sub.c", "p.sub", "p.e", "p.b", "p.a"]
