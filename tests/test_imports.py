"""No import cycles among phalanx's modules (imports inside functions and TYPE_CHECKING excluded).

A cycle makes the import order matter and turns a refactor into an ImportError; this
test keeps the module graph a DAG. The package root ``phalanx/__init__.py`` is left out:
it imports everything by design and nothing imports it.
"""
from __future__ import annotations

import ast
import os

import phalanx

ROOT = os.path.dirname(phalanx.__file__)


def module_name(path: str) -> str:
    rel = os.path.relpath(path, os.path.dirname(ROOT))[:-3].replace(os.sep, ".")
    return rel[:-len(".__init__")] if rel.endswith(".__init__") else rel


def top_level_imports(tree: ast.Module) -> list[ast.ImportFrom | ast.Import]:
    """Imports run at import time: module level, and inside top-level if/try, but not under TYPE_CHECKING."""
    found, todo = [], list(tree.body)
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append(node)
        elif isinstance(node, ast.If):
            if "TYPE_CHECKING" not in ast.unparse(node.test):
                todo += node.body + node.orelse
        elif isinstance(node, ast.Try):
            todo += node.body + node.orelse + node.finalbody + [n for h in node.handlers for n in h.body]
    return found


def graph() -> dict[str, set[str]]:
    modules = {}
    for folder, _, files in os.walk(ROOT):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(folder, f)
                modules[module_name(path)] = path
    edges: dict[str, set[str]] = {m: set() for m in modules}
    for name, path in modules.items():
        package = name if path.endswith("__init__.py") else name.rpartition(".")[0]
        for node in top_level_imports(ast.parse(open(path).read())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                base = package.rsplit(".", node.level - 1)[0] if node.level else ""
                stem = ".".join(p for p in (base, node.module or "") if p)
                targets = [f"{stem}.{a.name}" if f"{stem}.{a.name}" in modules else stem for a in node.names]
            edges[name] |= {t for t in targets if t in modules and t != "phalanx" and t != name}
    return edges


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    found, state, stack = [], {}, []

    def visit(m: str) -> None:
        state[m] = "open"
        stack.append(m)
        for n in sorted(edges[m]):
            if state.get(n) == "open":
                found.append(stack[stack.index(n):] + [n])
            elif n not in state:
                visit(n)
        stack.pop()
        state[m] = "done"

    for m in sorted(edges):
        if m not in state:
            visit(m)
    return found


def test_the_module_graph_has_no_cycles():
    assert cycles(graph()) == []


def test_the_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == [["a", "b", "c", "a"]]
