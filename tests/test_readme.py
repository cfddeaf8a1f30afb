"""The Python examples in README.md and docs/api.md run as pasted (training cut to one epoch), as a plain process."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGES = ["README.md", os.path.join("docs", "api.md")]  # pages whose ```python blocks promise to run as pasted

# One interpreter imports torch once (the second or so every example would spend on it), then forks a child per
# example that runs it as `python -c` would: in a fresh __main__ namespace, in its own folder, its own stdout and
# stderr. Only torch is imported before the fork: every example imports it itself, and a module the example forgets
# to import (phalanx, phalanx.bench, ...) is as absent in the child as in a plain process. torch._dynamo too: torch
# imports it on its own at the first optimizer an example makes (torch.optim, another second each), and gives it as
# torch._dynamo whether imported or not (torch's lazy submodules), so no example could forget it.
RUNNER = r"""
import json, os, sys, traceback
import torch  # noqa: F401 - imported once, before the forks
import torch._dynamo  # noqa: F401 - what torch.optim's first optimizer imports, once

runs = json.loads(sys.stdin.read())
codes = []
for code, folder in runs:
    pid = os.fork()
    if pid == 0:
        os.chdir(folder)
        for fd, name in ((1, "stdout"), (2, "stderr")):
            os.dup2(os.open(os.path.join(folder, name), os.O_WRONLY | os.O_CREAT | os.O_TRUNC), fd)
        status = 0
        try:
            exec(compile(code, "<string>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
        except SystemExit as err:
            status = err.code if isinstance(err.code, int) else (0 if err.code is None else 1)
        except BaseException:
            traceback.print_exc()
            status = 1
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)
    codes.append(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))
print(json.dumps(codes))
"""


def snippets() -> list[tuple[str, str]]:
    found = []
    for page in PAGES:
        with open(os.path.join(ROOT, page)) as f:
            found += [(page, code) for code in re.findall(r"```python\n(.*?)```", f.read(), flags=re.S)]
    return found


def shorten(code: str) -> str:
    return code.replace("range(10)", "range(1)").replace("epochs=8", "epochs=1")


def check_shortened(page: str, code: str) -> None:
    assert shorten(code) != code, f"an example in {page} changed: update how this test shortens it"


@pytest.fixture(scope="module")
def ran(tmp_path_factory) -> list[tuple[int, str]]:
    """Every example, shortened, each run in its own forked child of one interpreter: (exit status, stderr)."""
    runs = []
    for i, (_, code) in enumerate(snippets()):
        folder = tmp_path_factory.mktemp(f"example{i}")
        runs.append((shorten(code), str(folder)))
    proc = subprocess.run([sys.executable, "-c", RUNNER], input=json.dumps(runs), capture_output=True, text=True,
                          timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    codes = json.loads(proc.stdout.strip().splitlines()[-1])
    return [(c, open(os.path.join(folder, "stderr")).read()) for c, (_, folder) in zip(codes, runs, strict=True)]


@pytest.mark.parametrize("n", range(len(snippets())), ids=[f"{p}-{i}" for i, (p, _) in enumerate(snippets())])
def test_example_runs_as_pasted(n: int, ran: list[tuple[int, str]]) -> None:
    page, code = snippets()[n]
    check_shortened(page, code)  # the example is still one this test knows how to shorten
    status, stderr = ran[n]
    assert status == 0, stderr[-3000:]
