"""Whatever is written to the store's joiners list ends no job and slows no later commit.

Real workers under ``phalanx run --elastic``; worker 0 writes the garbage through the launcher's
real store, as anyone who reaches it can (``tests/workers/elastic_bogus_joiners.py``). The work of
a commit point is counted in store calls, not timed: 5,000 ids nobody admits are looked at once,
and every later commit asks the store as little as a commit with none.
"""
from __future__ import annotations

import glob
import json
import os

import pytest

from support.forked_launch import run_cli  # the launcher forked from this process, its workers from one server
from support.paths import TESTS

WORKER = os.path.join(TESTS, "workers", "elastic_bogus_joiners.py")
GARBAGE_AT, BOGUS_AT = 3, 7


@pytest.mark.multiproc
def test_garbage_and_thousands_of_bogus_joiners_neither_end_the_job_nor_slow_later_commits(tmp_path):
    argv = ["run", "-n", "2", "--elastic", WORKER, "--out", str(tmp_path),
            "--garbage-at", str(GARBAGE_AT), "--bogus-at", str(BOGUS_AT), "--bogus", "5000"]
    proc = run_cli(argv, str(tmp_path), timeout=150)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = [json.load(open(p)) for p in glob.glob(str(tmp_path / "worker*.json"))]
    assert len(results) == 2 and all(r["history"] == [] for r in results)  # nobody was admitted, nobody left
    assert proc.stderr.count("ignoring the store's elastic/joiners") == 1  # one warning for the bad value
    looks = [(step, calls) for r in results for step, calls in r["looks"]]
    before = [calls for step, calls in looks if step < GARBAGE_AT]
    later = [calls for step, calls in looks if step >= BOGUS_AT + 2]  # each entry is looked at once, then never
    assert before and later and [r["steps"] for r in results] == [16, 16]
    # the work per commit does not grow with the entries nobody admits: one check and one get, as with none
    assert max(before + later) <= 2, looks
