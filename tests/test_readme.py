"""The README's Python examples run when pasted (shortened to one epoch), as a plain process."""
from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

README = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "README.md")


def snippets() -> list[str]:
    with open(README) as f:
        return re.findall(r"```python\n(.*?)```", f.read(), flags=re.S)


@pytest.mark.parametrize("index", range(len(snippets())))
def test_readme_example_runs_as_pasted(index, tmp_path):
    code = snippets()[index]
    short = code.replace("range(10)", "range(1)").replace("epochs=8", "epochs=1")
    assert short != code, "the example changed: update how this test shortens it"
    proc = subprocess.run([sys.executable, "-c", short], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
