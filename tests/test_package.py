"""The package is the product: a training job imports no benchmark, demo or plotting code.

``phalanx demo`` and ``phalanx bench`` live in ``phalanx.bench`` behind the extra
``phalanx[bench]`` (scikit-learn, matplotlib); nothing else in the package imports them.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tomllib

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SRC = os.path.join(ROOT, "src", "phalanx")
APPS = ("sklearn", "matplotlib", "phalanx.bench")


def product_modules() -> list[str]:
    """Every module of the package outside ``phalanx.bench`` (``__main__`` entries excluded: they run a command)."""
    names = []
    for folder, dirs, files in os.walk(SRC):
        dirs[:] = sorted(d for d in dirs if d not in ("bench", "__pycache__"))
        for f in sorted(files):
            if f.endswith(".py") and f != "__main__.py":
                rel = os.path.relpath(os.path.join(folder, f), os.path.dirname(SRC))[:-3].replace(os.sep, ".")
                names.append(rel.removesuffix(".__init__"))
    return names


# ``phalanx demo``, ``phalanx bench`` (each one's exit status and stderr) and ``px.Downpour()`` (its error) with
# scikit-learn, matplotlib and pyzmq absent. Each call meets a missing extra first thing, so one process for the three
# tells what three would. sys.modules[name] = None is how Python marks a package as absent: find_spec says None,
# import fails.
WITHOUT_EXTRAS = """
import contextlib, io
sys.modules['sklearn'] = sys.modules['matplotlib'] = None
sys.modules['zmq'] = None
from phalanx.cli import main
got = {}
for command in ('demo', 'bench'):
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = main([command])
    got[command] = [code, err.getvalue()]
import phalanx as px
from phalanx.errors import ConfigError
try:
    px.Downpour()
except ConfigError as err:
    got['ps'] = str(err)
"""


def loaded_after(stages: list[list[str]]) -> tuple[list[dict], dict]:
    """In ONE fresh interpreter: import each stage's modules in turn; after each, which of APPS got loaded and which
    modules could not import. And, in a child forked from it once it has imported torch (and nothing of phalanx,
    scikit-learn, matplotlib or pyzmq: checked), what :data:`WITHOUT_EXTRAS` got.

    The last stage runs with scikit-learn and matplotlib counted as absent (as after ``pip install phalanx``): a
    module that needs either fails the import. The stages before it have proved that what they imported loads
    neither (their ``loaded`` is read before the block), so one interpreter tells what separate ones would, at
    the cost of one start-up of torch instead of one per stage; the child is that interpreter as it was before it
    imported anything of phalanx, so it tells what a fresh interpreter would, without a second start-up of torch.
    """
    code = f"""
import importlib, json, os, sys, traceback
import torch  # noqa: F401 - once, before the fork: the child and the stages share it
read, write = os.pipe()
if os.fork() == 0:
    os.close(read)
    status = 0
    try:
        early = [m for m in ('phalanx', 'sklearn', 'matplotlib', 'zmq') if m in sys.modules]
        assert not early, f'loaded before the fork: {{early}}'
        exec({WITHOUT_EXTRAS!r})
        os.write(write, json.dumps(got).encode())
    except BaseException:
        traceback.print_exc()
        status = 1
    sys.stderr.flush()
    os._exit(status)
os.close(write)
stages = {stages!r}
for n, modules in enumerate(stages):
    if n == len(stages) - 1:
        sys.modules['sklearn'] = sys.modules['matplotlib'] = None
    skipped = {{}}
    for name in modules:
        try:
            importlib.import_module(name)
        except ImportError as err:  # an optional package (keras, redis...) this machine lacks
            if (err.name or "").startswith(("phalanx", "sklearn", "matplotlib")):
                raise
            skipped[name] = err.name
    print(json.dumps({{"loaded": [m for m in {APPS!r} if sys.modules.get(m) is not None], "skipped": skipped}}))
with os.fdopen(read, "rb") as pipe:
    child = pipe.read()
if os.waitstatus_to_exitcode(os.wait()[1]) != 0:
    sys.exit("the child without the extras failed (its traceback is above)")
print(child.decode())
"""
    env = {**os.environ, "KERAS_BACKEND": "torch"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.strip().splitlines()
    return [json.loads(line) for line in lines[-len(stages) - 1:-1]], json.loads(lines[-1])


@pytest.fixture(scope="module")
def interpreter() -> dict:
    """``import phalanx``; then every core and feature module but px.keras; then all of them, sklearn and
    matplotlib absent. Keras itself imports scikit-learn and matplotlib when they are installed, so px.keras is
    checked with both absent; every other module must not even load them. And what :data:`WITHOUT_EXTRAS` got."""
    modules = product_modules()
    plain = [m for m in modules if not m.startswith("phalanx.keras")]
    (first, second, blocked), without = loaded_after([["phalanx"], plain, modules])
    return {"modules": modules, "phalanx": first, "plain": second, "blocked": blocked, "without_extras": without}


@pytest.fixture(scope="module")
def imports(interpreter: dict) -> dict:
    """What each stage of :func:`interpreter` loaded."""
    return interpreter


def test_import_phalanx_loads_no_app_and_no_plotting_or_sklearn(imports: dict) -> None:
    assert imports["phalanx"]["loaded"] == []


def test_no_core_or_feature_module_imports_the_apps(imports: dict) -> None:
    modules = imports["modules"]
    assert "phalanx.train.trainer" in modules and "phalanx.keras.fit" in modules and "phalanx.ps.server" in modules
    assert not any(m.startswith("phalanx.bench") for m in modules)
    assert imports["plain"]["loaded"] == []
    assert imports["blocked"]["loaded"] == []


def test_core_requirements_hold_neither_sklearn_nor_matplotlib() -> None:
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        project = tomllib.load(f)["project"]

    def names(reqs: list[str]) -> set[str]:
        return {re.split(r"[\s<>=!~;\[]", r, maxsplit=1)[0].lower() for r in reqs}

    assert names(project["dependencies"]) == {"torch", "numpy", "tqdm"}
    extras = project["optional-dependencies"]
    assert names(extras["bench"]) == {"scikit-learn", "matplotlib"}
    assert names(extras["ps"]) == {"pyzmq"}
    pulled = {e for d in extras["dev"] if d.startswith("phalanx[") for e in d[len("phalanx["):-1].split(",")}
    assert pulled == set(extras) - {"dev"}  # the tests use every extra


@pytest.fixture(scope="module")
def without_extras(interpreter: dict) -> dict:
    """With scikit-learn, matplotlib and pyzmq absent (:data:`WITHOUT_EXTRAS`, run in :func:`interpreter`'s fork):
    ``phalanx demo``, ``phalanx bench`` (each one's exit status and stderr) and ``px.Downpour()`` (its error)."""
    return interpreter["without_extras"]


@pytest.mark.parametrize("command", ["demo", "bench"])
def test_an_app_without_its_extra_says_what_to_install_in_one_line(without_extras: dict, command: str) -> None:
    code, stderr = without_extras[command]
    assert code == 2, stderr
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and "pip install 'phalanx[bench]'" in lines[0], stderr


def test_a_parameter_server_without_pyzmq_says_what_to_install(without_extras: dict) -> None:
    ps = without_extras.get("ps", "")
    assert "pyzmq" in ps and "phalanx[ps]" in ps, without_extras


# -- the harness stays out of the product ------------------------------------------------------------------------------
HARNESS = ("quality", "targets", "gpu", "torchft_peer")  # benchmarks/: what measures the product, never shipped in it


def test_the_package_ships_no_harness_and_imports_no_benchmark_code() -> None:
    import ast

    src = os.path.dirname(os.path.dirname(os.path.abspath(__import__("phalanx").__file__)))
    shipped, imports = [], []
    for folder, dirs, files in os.walk(os.path.join(src, "phalanx")):
        for name in dirs + files:
            if name.removesuffix(".py") in HARNESS:
                shipped.append(os.path.relpath(os.path.join(folder, name), src))
        for f in (f for f in files if f.endswith(".py")):
            for node in ast.walk(ast.parse(open(os.path.join(folder, f)).read())):
                mods = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                        [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
                imports += [f"{f}: {m}" for m in mods if m.split(".")[0] in ("benchmarks", "torchft")]
    assert shipped == [] and imports == [], f"move these to benchmarks/: {shipped + imports}"
