"""Every name the package uses is defined: pyflakes' checks (ruff's F rules) over src/ and tests/.

Two branches merged cleanly once left `strategy_of` used in phalanx/elastic/state.py and imported nowhere; every
`px.elastic.State` then failed with a NameError at run time, in every elastic test at once. This check fails in a
second instead.
"""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_no_undefined_or_unused_name_in_the_package_or_its_tests():
    ruff = shutil.which("ruff", path=str(Path(sys.executable).parent)) or shutil.which("ruff")
    if ruff is None:
        pytest.skip("ruff is not installed (it comes with the dev extra: make setup)")
    out = subprocess.run([ruff, "check", "--select", "F", "--no-cache", "src", "tests", "benchmarks"], cwd=ROOT,
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stdout[-3000:]
