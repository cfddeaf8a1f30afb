"""phalanx's import graph: no cycles, and layers that point one way.

A cycle makes the import order matter and turns a refactor into an ImportError; the
cycle test keeps the graph of imports run at import time a DAG (imports inside
functions and under TYPE_CHECKING excluded). The layer test reads every import,
function-level ones included (an ``ast.walk`` of each whole file), since an import
inside a function is still an edge: core <- features (elastic, ps, stream, keras) <-
apps (the launchers, the CLI, the Ray backend, bench and its demos), after the map
:data:`LAYERS`. The core never imports a feature or an app; a feature never imports
another feature or an app. The package root ``phalanx/__init__.py`` is left out: it
composes everything by design (``px.init`` = the core's group + elastic's place in it)
and nothing imports it.
"""
from __future__ import annotations

import ast
import os
import subprocess
import sys

import phalanx

ROOT = os.path.dirname(phalanx.__file__)


def module_name(path: str) -> str:
    rel = os.path.relpath(path, os.path.dirname(ROOT))[:-3].replace(os.sep, ".")
    return rel[:-len(".__init__")] if rel.endswith(".__init__") else rel


def _imports(tree: ast.Module, *, anywhere: bool) -> list[ast.ImportFrom | ast.Import]:
    """The imports below ``tree``, none under TYPE_CHECKING; ``anywhere``: functions too (only an ``else`` of a
    TYPE_CHECKING test), else only what runs at import time (module level, and inside top-level if/try)."""
    found, todo = [], list(tree.body)
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append(node)
        elif isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            todo += node.orelse if anywhere else []
        elif anywhere:
            todo += list(ast.iter_child_nodes(node))
        elif isinstance(node, ast.If):
            todo += node.body + node.orelse
        elif isinstance(node, ast.Try):
            todo += node.body + node.orelse + node.finalbody + [n for h in node.handlers for n in h.body]
    return found


def top_level_imports(tree: ast.Module) -> list[ast.ImportFrom | ast.Import]:
    """Imports run at import time: module level, and inside top-level if/try, but not under TYPE_CHECKING."""
    return _imports(tree, anywhere=False)


def run_time_imports(tree: ast.Module) -> list[ast.ImportFrom | ast.Import]:
    """Every import that can run: anywhere in the module (functions too), but not under TYPE_CHECKING."""
    return _imports(tree, anywhere=True)


def every_import(tree: ast.Module) -> list[ast.ImportFrom | ast.Import]:
    """Every import statement anywhere in the module: functions, methods, branches, TYPE_CHECKING blocks too.

    A type-only import is still an edge a reader follows, so it obeys the layers as well.
    """
    return [n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))]


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


def test_no_import_inside_a_function_hides_a_cycle():
    # Deferring one import of a cycle into a function makes it load, not go away: the two modules still need each
    # other (comm <-> profiling did, preempt -> checkpoint -> ... -> steps -> preempt did).
    assert cycles(graph(run_time_imports)) == []


def test_the_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == [["a", "b", "c", "a"]]


# -- layers ----------------------------------------------------------------------------------------------------------
# The floors of the house, bottom up, one tuple a floor; a name is a top-level module or package of src/phalanx. A
# module may import from its own package and from any lower floor, never from its floor's other rooms or above: the
# features (elastic, ps, stream, keras) share a floor, so none imports another; the core (up to train) imports none.
FLOORS = (
    ("errors",), ("check",), ("framing",), ("sealed",),  # base: failures, argument checks, framed files, sealed dirs
    ("group",),                                     # who is in the run and how they talk
    ("step",),                                      # one step: clock, end of backward, compile, preemption, profiling
    ("data",),                                      # which samples each worker reads
    ("strategies",),                                # how replicas agree, with their codecs
    ("sharding",),                                  # FSDP2 layout and resharding
    ("wrap",),                                      # where a rule meets the user's model
    ("checkpoint",),                                # verified, atomic, resharding checkpoints
    ("train",),                                     # the Trainer and what it reports
    ("elastic", "ps", "stream", "keras"),           # features
    ("monitor",),                                   # the job seen from outside: status page, /metrics
    ("launch",),                                    # processes around the workers
    ("raytrain",),                                  # phalanx.launch.raytrain's old name, for one release
    ("bench", "cli"),                               # what users run
)
FEATURES = ("elastic", "ps", "stream", "keras")
LEVEL = {"core": 0, "feature": 1, "app": 2}
_FEATURE_FLOOR = FLOORS.index(FEATURES)
LAYERS = {"core": tuple(n for floor in FLOORS[:_FEATURE_FLOOR] for n in floor), "feature": FEATURES,
          "app": tuple(n for floor in FLOORS[_FEATURE_FLOOR + 1:] for n in floor)}
FLOOR = {name: i for i, floor in enumerate(FLOORS) for name in floor}


def room(module: str) -> str:
    """The top-level module or package a module belongs to (its room)."""
    return (module.split(".", 1)[1] if "." in module else module).split(".")[0]


def layer(module: str) -> tuple[str, str]:
    """(layer, unit) of a module; a feature's unit is its subpackage, whose own modules may import each other."""
    top = room(module)
    for name, tops in LAYERS.items():
        if top in tops:
            return name, top if name == "feature" else name
    return "unknown", top


def layering_violations(edges: dict[str, set[str]]) -> list[str]:
    """Edges that point up a layer (core -> feature, feature -> app, ...) or across features."""
    bad = []
    for source, targets in sorted(edges.items()):
        src_layer, src_unit = layer(source)
        for target in sorted(targets):
            dst_layer, dst_unit = layer(target)
            if "unknown" in (src_layer, dst_layer):
                continue  # test_every_module_has_a_layer names it
            if LEVEL[dst_layer] > LEVEL[src_layer]:
                bad.append(f"{src_layer} {source} imports {dst_layer} {target}")
            elif src_layer == dst_layer == "feature" and dst_unit != src_unit:
                bad.append(f"feature {source} imports another feature, {target}")
    return bad


def floor_violations(edges: dict[str, set[str]]) -> list[str]:
    """Edges that point up a floor or across rooms of one floor."""
    bad = []
    for source, targets in sorted(edges.items()):
        a = room(source)
        for target in sorted(targets):
            b = room(target)
            if a == b or a not in FLOOR or b not in FLOOR:
                continue
            if FLOOR[b] >= FLOOR[a]:
                bad.append(f"{source} (floor {FLOOR[a]}) imports {target} (floor {FLOOR[b]})")
    return bad


def test_every_room_of_the_package_is_on_a_floor():
    tops = {n.removesuffix(".py") for n in os.listdir(ROOT) if n.endswith(".py") or
            os.path.exists(os.path.join(ROOT, n, "__init__.py"))} - {"__init__"}
    assert sorted(tops - set(FLOOR)) == [], "place each new package on a floor in FLOORS"


def test_imports_point_down_the_floors():
    assert floor_violations(graph(every_import)) == []


def test_the_floor_check_sees_an_upward_and_a_sideways_import():
    assert floor_violations({"phalanx.group.collectives": {"phalanx.step.profiling", "phalanx.errors"},
                             "phalanx.ps.link": {"phalanx.stream.loader", "phalanx.ps.wire"}}) == [
        "phalanx.group.collectives (floor 4) imports phalanx.step.profiling (floor 5)",
        "phalanx.ps.link (floor 12) imports phalanx.stream.loader (floor 12)"]


def test_every_module_has_a_layer():
    unknown = sorted(m for m in graph() if layer(m)[0] == "unknown" and m != "phalanx")
    assert unknown == [], f"add these to LAYERS in {__name__}: {unknown}"


def test_the_core_never_imports_a_feature_and_features_never_import_each_other():
    assert layering_violations(graph(every_import)) == []


def test_the_layer_check_sees_every_import():
    tree = ast.parse("def f():\n    if x:\n        from ..elastic import worker\n"
                     "class C:\n    def g(self):\n        import phalanx.ps\n"
                     "if TYPE_CHECKING:\n    from .keras import fit\n")
    assert sorted(str(getattr(n, "module", None) or n.names[0].name) for n in every_import(tree)) == [
        "elastic", "keras", "phalanx.ps"]
    assert layering_violations({"phalanx.ps.link": {"phalanx.elastic.worker"},
                                "phalanx.wrap": {"phalanx.keras.detect"},
                                "phalanx.train.trainer": {"phalanx.elastic.commits"},
                                "phalanx.elastic.worker": {"phalanx.launch.elastic"},
                                "phalanx.ps.strategies": {"phalanx.ps.link", "phalanx.strategies.base"}}) == [
        "feature phalanx.elastic.worker imports app phalanx.launch.elastic",
        "feature phalanx.ps.link imports another feature, phalanx.elastic.worker",
        "core phalanx.train.trainer imports feature phalanx.elastic.commits",
        "core phalanx.wrap imports feature phalanx.keras.detect"]
    assert layering_violations({"phalanx.launch.run": {"phalanx.launch.elastic", "phalanx.ps.launcher"},
                                "phalanx.launch.elastic": {"phalanx.ps.launcher", "phalanx.elastic.watch"},
                                "phalanx.launch.raytrain": {"phalanx.launch.elastic"}}) == []


# phalanx.checkpoint, one concept a module: the directory's format (dcp; its files read back checked by dcp_reader),
# the one-file format (legacy) and the workers'
# store protocol (agreement) know nothing of each other; handle puts a save in place with them; snapshot is the fork
# that copies an asynchronous save's state, staging the copy in the call and beside training; writer is the process
# an asynchronous save writes from; saver and loader are the entry points. Each module may import only those before it.
CHECKPOINT_ORDER = ("training_state", "dcp_reader", "dcp", "hashing", "legacy", "agreement", "handle", "snapshot",
                    "staging", "writer_child", "writer", "saver", "loader")


def test_the_checkpoint_package_imports_one_way():
    edges = graph(every_import)
    modules = sorted(m.rsplit(".", 1)[1] for m in edges if m.startswith("phalanx.checkpoint."))
    assert modules == sorted(CHECKPOINT_ORDER), f"place the new module in CHECKPOINT_ORDER: {modules}"
    bad = []
    for i, name in enumerate(CHECKPOINT_ORDER):
        for target in sorted(edges[f"phalanx.checkpoint.{name}"]):
            if target.startswith("phalanx.checkpoint") and target.rsplit(".", 1)[1] not in CHECKPOINT_ORDER[:i]:
                bad.append(f"phalanx.checkpoint.{name} imports {target}")
    assert bad == []


def test_import_phalanx_leaves_the_heavy_torch_modules_out():
    # Each costs 1-2 s of every worker's start; they are imported where they are used, on first use.
    heavy = ["torch.distributed.checkpoint", "torch.distributed.fsdp", "torch.distributed.tensor", "torch._dynamo"]
    code = f"import sys, phalanx; print([m for m in {heavy!r} if m in sys.modules])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(ROOT))}).stdout
    assert out.strip() == "[]"
