"""``--replace``: a replacement's start-up never blocks the survivors; it enters at a later commit once ready.

Worker 1 is SIGKILLed inside the commit of step 4 (a kill at a commit point). Its replacement gets its
place from ``px.init()`` and holds its start-up until the survivors have trained 3 steps without it
(``tests/workers/elastic_slow_replacement.py``): an event, not a timer. If the survivors waited for the
replacement's start-up (admitting it at their regroup, or at a commit point, before it was ready) they
would never train those steps, and the replacement gives up.
"""
from __future__ import annotations

import glob
import json
import os

import pytest
import torch

from support.forked_launch import run_cli  # the launcher forked from this process, its workers from one server
from support.paths import TESTS
from workers import elastic as base

WORKER = os.path.join(TESTS, "workers", "elastic_slow_replacement.py")


@pytest.mark.multiproc
def test_the_survivors_train_on_while_the_replacement_starts_and_it_joins_at_a_later_commit(tmp_path):
    argv = ["run", "-n", "3", "--elastic", "--min-workers", "2", "--replace", WORKER, "--out", str(tmp_path)]
    proc = run_cli(argv, str(tmp_path), timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = {json.load(open(p))["id"]: json.load(open(p)) for p in glob.glob(str(tmp_path / "worker*.json"))}
    assert sorted(results) == ["0", "2", "r1"], proc.stderr[-3000:]
    main, joiner = results["0"], results["r1"]
    # two changes: the loss (rolled back to the commit of step 4, nothing redone) and, later, the join
    assert [(h["left"], h["joined"], h["step"]) for h in main["history"]][0] == (["1"], [], 4)
    [(_, joined, at)] = [(h["left"], h["joined"], h["step"]) for h in main["history"]][1:]
    assert joined == ["r1"] and at > 4 + 3 and len(main["without"]) >= 3
    # what px.init() told the replacement is the place it took
    assert json.load(open(tmp_path / "initr1.json")) == {"rank": 2, "world_size": 3}
    record = main["record"]
    assert joiner["record"] == record and results["2"]["record"] == record
    assert [w for _, w, _ in record] == [3] * 4 + [2] * (at - 4) + [3] * (len(record) - at)
    for epoch in range(4):  # every sample once per epoch
        ids = [i for e, _, step in record for i in step if e == epoch]
        assert ids == torch.randperm(base.N, generator=torch.Generator().manual_seed(epoch)).tolist()
    for r in results.values():
        for got, want in zip(r["params"], base.oracle(record), strict=True):
            torch.testing.assert_close(torch.tensor(got), want, rtol=1e-5, atol=1e-6)
