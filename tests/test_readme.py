"""The Python examples in README.md and docs/api.md run as pasted (training cut to one epoch), as a plain process."""
from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGES = ["README.md", os.path.join("docs", "api.md")]  # pages whose ```python blocks promise to run as pasted


def snippets() -> list[tuple[str, str]]:
    found = []
    for page in PAGES:
        with open(os.path.join(ROOT, page)) as f:
            found += [(page, code) for code in re.findall(r"```python\n(.*?)```", f.read(), flags=re.S)]
    return found


@pytest.mark.parametrize("page,code", snippets(), ids=[f"{p}-{i}" for i, (p, _) in enumerate(snippets())])
def test_example_runs_as_pasted(page, code, tmp_path):
    short = code.replace("range(10)", "range(1)").replace("epochs=8", "epochs=1")
    assert short != code, f"an example in {page} changed: update how this test shortens it"
    proc = subprocess.run([sys.executable, "-c", short], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
