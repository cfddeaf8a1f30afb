"""The phalanx side of the porting pages (docs/porting/*.md) runs as pasted, as a plain process (a group of one).

Every ```python block of those pages is a whole program; blocks that need another framework (Ray, torchft,
Horovod, Keras) or several workers are ```py and are not run. The blocks run one after the other in ONE
interpreter (each in its own directory and namespace), so the suite pays for importing torch once.
"""
from __future__ import annotations

import glob
import json
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGES = sorted(glob.glob(os.path.join(ROOT, "docs", "porting", "*.md")))
ORIGINS = {"ddp.md", "fsdp2.md", "ray-train.md", "torchft.md", "horovod.md", "keras.md"}

RUNNER = """
import json, os, sys, traceback
for i, (page, code) in enumerate(json.loads(sys.argv[1])):
    os.makedirs(str(i)); os.chdir(str(i))
    try:
        exec(compile(code, page, "exec"), {"__name__": "__main__"})
    except BaseException:
        sys.exit(page + ":\\n" + traceback.format_exc())
    os.chdir("..")
"""


def blocks() -> list[tuple[str, str]]:
    found = []
    for page in PAGES:
        with open(page) as f:
            found += [(os.path.basename(page), code) for code in re.findall(r"```python\n(.*?)```", f.read(), re.S)]
    return found


def test_every_origin_has_a_page_and_the_ddp_page_a_runnable_program():
    assert ORIGINS <= {os.path.basename(p) for p in PAGES}
    assert "ddp.md" in {page for page, _ in blocks()}


def test_the_phalanx_side_of_every_page_runs_as_pasted(tmp_path):
    # one epoch instead of two: the test checks that the code runs, not what it learns
    short = [(page, code.replace("range(2)", "range(1)").replace("epochs(2)", "epochs(1)")) for page, code in blocks()]
    assert all(s != c for (_, s), (_, c) in zip(short, blocks())), "a page's loop changed: update how this test cuts it"
    proc = subprocess.run([sys.executable, "-c", RUNNER, json.dumps(short)], cwd=tmp_path, capture_output=True,
                          text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
