"""The house's figures (issue 37's table), each counted from the tree as it is now: one command prints them all.

    python benchmarks/house.py            # the table
    python benchmarks/house.py --json     # the same, machine-readable

What each row counts:

* **modules directly in src/phalanx**: ``*.py`` files at the package's top level.
* **Strategy members**: non-dunder methods and class-level attributes of every class in ``px.Strategy``'s MRO
  that lives in phalanx (as ``tests/strategies/test_strategy_protocol.py`` counts them).
* **Group attributes typed Any**: annotations in ``Group``'s class body and ``self.x: ...`` in its methods whose
  annotation mentions ``Any``.
* **reads of `.elastic` outside elastic/ and launch/**: attribute reads named ``elastic`` on anything but the
  ``phalanx``/``px`` module (so ``px.elastic.run`` does not count, ``g.elastic`` does), outside ``__repr__`` and
  outside ``group/group.py``, the Group's own module, which holds the field (how it forms its own process groups
  follows from it: ``Group.owns_groups``).
* **harness lines in the package**: lines under ``src/phalanx`` in a ``quality/`` folder, a ``targets.py`` or a
  ``gpu.py`` (the benchmark harness lives in ``benchmarks/``).
* **duplicate pairs touching tests/ or benchmarks/**: rows of the ``duplicates`` tool (>= 6 lines) naming either.
* **``sleep(`` calls in tests/**, and how many carry no ``# sleep: reason`` (``tests/test_sleeps.py`` keeps that 0).
* **docs/performance.md lines**.
"""
from __future__ import annotations

import argparse
import ast
import json
import os
import re
import shutil
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SRC = os.path.join(ROOT, "src", "phalanx")

TARGETS = {"modules directly in src/phalanx": 8, "Strategy members": 8, "Group attributes typed Any": 0,
           "reads of .elastic outside elastic/ and launch/": 0, "harness lines in the package": 0,
           "duplicate pairs touching tests/ or benchmarks/": 5, "sleep( calls in tests/": 20,
           "docs/performance.md lines": 600}


def _py_files(top: str) -> list[str]:
    return sorted(os.path.join(d, f) for d, _, fs in os.walk(top) for f in fs if f.endswith(".py"))


def _package_modules() -> list[tuple[str, str]]:
    """(path relative to src/phalanx, path) of every module of the package."""
    return [(os.path.relpath(path, SRC), path) for path in _py_files(SRC)]


def top_level_modules() -> int:
    return sum(1 for f in os.listdir(SRC) if f.endswith(".py"))


def strategy_members() -> int:
    sys.path.insert(0, os.path.join(ROOT, "src"))
    import phalanx as px

    names: set[str] = set()
    for klass in px.Strategy.__mro__:
        if klass.__module__.split(".")[0] == "phalanx":
            names |= {n for n in vars(klass) if not (n.startswith("__") and n.endswith("__"))}
    return len(names)


def group_any_attributes() -> int:
    tree = ast.parse(open(os.path.join(SRC, "group", "group.py")).read())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Group")
    count = 0
    for node in ast.walk(cls):
        if isinstance(node, ast.AnnAssign) and re.search(r"\bAny\b", ast.unparse(node.annotation)):
            count += 1
    return count


def elastic_reads() -> int:
    count = 0
    for rel, path in _package_modules():
        if rel.startswith(("elastic" + os.sep, "launch" + os.sep)) or rel == os.path.join("group", "group.py"):
            continue
        tree = ast.parse(open(path).read())
        reprs = {id(n) for f in ast.walk(tree) if isinstance(f, ast.FunctionDef) and f.name == "__repr__"
                 for n in ast.walk(f)}  # printing the mode is not branching on it
        for node in ast.walk(tree):
            if id(node) in reprs:
                continue
            if isinstance(node, ast.Attribute) and node.attr == "elastic" and isinstance(node.ctx, ast.Load):
                base = node.value
                if isinstance(base, ast.Name) and base.id in ("px", "phalanx"):
                    continue
                count += 1
    return count


def harness_lines() -> int:
    harness = [path for rel, path in _package_modules()
               if f"{os.sep}quality{os.sep}" in os.sep + rel or os.path.basename(rel) in ("targets.py", "gpu.py")]
    return sum(1 for path in harness for _ in open(path))


def duplicate_pairs() -> int | None:
    tool = shutil.which("duplicates")
    if tool is None:
        return None
    out = subprocess.run([tool, "--most", "200", "--seconds", "120"], cwd=ROOT, capture_output=True, text=True).stdout
    return sum(1 for line in out.splitlines()
               if re.match(r"\s*D\d+ ", line) and ("tests/" in line or "benchmarks/" in line))


def sleeps() -> tuple[int, int]:
    total = unexplained = 0
    for path in _py_files(os.path.join(ROOT, "tests")):
        previous = ""
        for line in open(path):
            if "sleep(" in line and not line.lstrip().startswith(("#", '"', "'")) and "sleep(`" not in line:
                total += 1
                unexplained += "# sleep:" not in line and "# sleep:" not in previous  # the reason: here or above
            previous = line
    return total, unexplained


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", action="store_true")
    a = p.parse_args()
    total, unexplained = sleeps()
    figures = {
        "modules directly in src/phalanx": top_level_modules(),
        "Strategy members": strategy_members(),
        "Group attributes typed Any": group_any_attributes(),
        "reads of .elastic outside elastic/ and launch/": elastic_reads(),
        "harness lines in the package": harness_lines(),
        "duplicate pairs touching tests/ or benchmarks/": duplicate_pairs(),
        "sleep( calls in tests/": total,
        "docs/performance.md lines": sum(1 for _ in open(os.path.join(ROOT, "docs", "performance.md"))),
    }
    if a.json:
        print(json.dumps({"figures": figures, "targets": TARGETS, "sleeps without a reason": unexplained}, indent=1))
        return
    print(f"{'figure':50} {'now':>6} {'target':>7}")
    for name, value in figures.items():
        shown = "n/a" if value is None else str(value)
        ok = value is not None and value <= TARGETS[name]
        print(f"{name:50} {shown:>6} {'<= ' + str(TARGETS[name]):>7} {'' if ok else '  (not met)'}")
    print(f"sleep( calls in tests/ without a '# sleep: reason': {unexplained}")


if __name__ == "__main__":
    main()
