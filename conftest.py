"""pytest at the repository root: the doctests in ``src/phalanx`` run with ``make test``.

A module whose optional packages (keras, redis, zmq...) are not installed is left out
of doctest collection, as is any phalanx module that imports it at import time.
"""
from __future__ import annotations

import ast
import importlib.util
import os
import sys

SRC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "src", "phalanx")


def _imports(path: str, package: str) -> tuple[set[str], set[str]]:
    """(third-party top-level names, phalanx modules) imported at module level outside try/TYPE_CHECKING."""
    outside, inside = set(), set()
    for node in ast.parse(open(path, encoding="utf-8").read()).body:
        if isinstance(node, ast.Import):
            outside |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            outside.add(node.module.split(".")[0])
        elif isinstance(node, ast.ImportFrom):
            base = package.rsplit(".", node.level - 1)[0]
            stem = ".".join(p for p in (base, node.module or "") if p)
            inside |= {stem} | {f"{stem}.{a.name}" for a in node.names}
    return outside - {"phalanx"} - set(sys.stdlib_module_names), inside


def _unimportable() -> list[str]:
    modules = {}
    for folder, _, files in os.walk(SRC):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(folder, f)
                rel = os.path.relpath(path, os.path.dirname(SRC))[:-3].replace(os.sep, ".")
                name = rel[:-len(".__init__")] if rel.endswith(".__init__") else rel
                package = name if f == "__init__.py" else name.rpartition(".")[0]
                modules[name] = (path, *_imports(path, package))
    bad = {n for n, (_, third, _) in modules.items() if any(importlib.util.find_spec(t) is None for t in third)}
    while True:  # a module importing a left-out module is left out too
        more = {n for n, (_, _, inner) in modules.items() if n not in bad and inner & bad}
        if not more:
            return [modules[n][0] for n in bad]
        bad |= more


collect_ignore = _unimportable()
