"""phalanx's import graph: no cycles, and layers that point one way.

A cycle makes the import order matter and turns a refactor into an ImportError; the
cycle test keeps the graph of imports run at import time a DAG (imports inside
functions and under TYPE_CHECKING excluded). The layer test reads every import,
function-level ones included, since an import inside a function is still an edge:
core <- features (elastic, ps, stream, keras) <- apps (launcher, CLI, bench, demos).
The core never imports a feature or an app; a feature never imports another feature.
The package root ``phalanx/__init__.py`` is left out: it imports everything by design
and nothing imports it.
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


def every_import(tree: ast.Module) -> list[ast.ImportFrom | ast.Import]:
    """Every import statement anywhere in the module (functions, classes, branches), but not under TYPE_CHECKING."""
    found, todo = [], list(tree.body)
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append(node)
        elif isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            todo += node.orelse
        else:
            todo += list(ast.iter_child_nodes(node))
    return found


def graph(imports=top_level_imports) -> dict[str, set[str]]:
    modules = {}
    for folder, _, files in os.walk(ROOT):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(folder, f)
                modules[module_name(path)] = path
    edges: dict[str, set[str]] = {m: set() for m in modules}
    for name, path in modules.items():
        package = name if path.endswith("__init__.py") else name.rpartition(".")[0]
        for node in imports(ast.parse(open(path).read())):
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


# -- layers ----------------------------------------------------------------------------------------------------------
CORE = ("_engine", "allocator", "backward", "callbacks", "check", "checkpoint", "comm", "compiled",
        "compression", "data", "epoch_report", "errors", "framing", "group", "liveness", "lr", "metrics",
        "preempt", "prefetch", "profiling", "progress", "quantize", "sharding", "state", "steps", "strategies", "sync",
        "workerenv", "wrap")
FEATURES = ("elastic", "ps", "stream", "keras", "tracking")
# The Trainer composes features (Trainer.fit(elastic=...)); nothing below it imports it.
COMPOSED = ("trainer",)
# The launcher's side, the CLI, benchmarks and demos. phalanx.elastic.agent and .join are the launcher processes
# of `phalanx run --elastic` and `phalanx join` (the agent starts and restarts parameter servers too); no worker
# imports them. phalanx.raytrain is the Ray Train backend: it runs in Ray's controller, and no worker imports it.
APPS = ("bench", "cli", "launch", "launch_failures", "launch_slurm", "demo", "demo_table", "models", "testing",
        "__main__", "elastic.agent", "elastic.join", "raytrain")
LEVEL = {"core": 0, "feature": 1, "composed": 2, "app": 3}


def layer(module: str) -> tuple[str, str]:
    """(layer, unit) of a module; a feature's unit is its subpackage, whose own modules may import each other."""
    rest = module.split(".", 1)[1] if "." in module else module
    top = rest.split(".")[0]
    if rest in APPS or top in APPS:
        return "app", top
    if top in FEATURES:
        return "feature", top
    if top in COMPOSED:
        return "composed", top
    if top in CORE:
        return "core", "core"
    return "unknown", top


def layering_violations(edges: dict[str, set[str]]) -> list[str]:
    """Edges that point up a layer (core -> feature, ...) or across features.

    A feature's demo importing an app (the bundled data and models) is not checked here: those
    demos leave the package with the benchmarks.
    """
    bad = []
    for source, targets in sorted(edges.items()):
        src_layer, src_unit = layer(source)
        for target in sorted(targets):
            dst_layer, dst_unit = layer(target)
            if "unknown" in (src_layer, dst_layer):
                continue  # test_every_module_has_a_layer names it
            if LEVEL[dst_layer] > LEVEL[src_layer] and not (src_layer == "feature" and dst_layer == "app"):
                bad.append(f"{src_layer} {source} imports {dst_layer} {target}")
            elif src_layer == dst_layer == "feature" and dst_unit != src_unit:
                bad.append(f"feature {source} imports another feature, {target}")
    return bad


def test_every_module_has_a_layer():
    unknown = sorted(m for m in graph() if layer(m)[0] == "unknown" and m != "phalanx")
    assert unknown == [], f"add these to CORE, FEATURES or APPS in {__name__}: {unknown}"


def test_the_core_never_imports_a_feature_and_features_never_import_each_other():
    assert layering_violations(graph(every_import)) == []


def test_the_layer_check_sees_an_import_inside_a_function():
    tree = ast.parse("def f():\n    if x:\n        from ..elastic import worker\n")
    assert [n.module for n in every_import(tree)] == ["elastic"]
    assert layering_violations({"phalanx.ps.link": {"phalanx.elastic.worker"},
                                "phalanx.wrap": {"phalanx.keras.detect"},
                                "phalanx.ps.strategies": {"phalanx.ps.link", "phalanx.strategies.base"}}) == [
        "feature phalanx.ps.link imports another feature, phalanx.elastic.worker",
        "core phalanx.wrap imports feature phalanx.keras.detect"]
    assert layering_violations({"phalanx.launch": {"phalanx.elastic.agent", "phalanx.ps.launcher"},
                                "phalanx.elastic.agent": {"phalanx.ps.launcher"},
                                "phalanx.trainer": {"phalanx.elastic.state"},
                                "phalanx.comm": {"phalanx.trainer"}}) == [
        "core phalanx.comm imports composed phalanx.trainer"]
