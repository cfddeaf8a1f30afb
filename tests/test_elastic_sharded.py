"""Elastic training with sharded state: ``phalanx run --elastic`` with ``shard=px.FullyShard(group_size=2)``.

4 workers = 2 replica groups x 2 shards (HSDP) train ``tests/workers/elastic.py``; the worker
started as rank 1 (shard 1 of group 0) is killed with SIGKILL. The survivors rebuild the
group, take the lost shard from the surviving replica group, re-shard the model and the
optimizer onto the 3 of them, and go on; the result equals one process trained on the same
global batches (the oracle of tests/test_elastic.py).
"""
from __future__ import annotations

import glob
import json

import pytest
import torch

from test_elastic import launch
from workers import elastic as worker


@pytest.mark.multiproc
def test_hsdp_2x2_loses_a_worker_reshards_onto_3_and_matches_the_oracle(tmp_path):
    proc, results = launch(tmp_path, "--min-workers", "3", "--", "--shard", "2", "--kill", "1@5",
                           "--commit-every", "3", n=4, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sorted(results) == ["0", "2", "3"]
    for wid, r in results.items():  # the same processes went on
        assert len(glob.glob(str(tmp_path / f"start{wid}-*.json"))) == 1
        assert r["world_size"] == 3 and [h["left"] for h in r["history"]] == [["1"]]
    record = results["0"]["record"]
    assert all(r["record"] == record for r in results.values())
    worlds = [w for _, w, _ in record]
    assert worlds == [4] * 3 + [3] * (len(worlds) - 3)  # rolled back to the commit at step 3
    for epoch in (0, 1):  # every sample once per epoch
        ids = [i for e, _, step in record for i in step if e == epoch]
        assert ids == torch.randperm(worker.N, generator=torch.Generator().manual_seed(epoch)).tolist()
    for r in results.values():
        for got, want in zip(r["params"], worker.oracle(record), strict=True):
            torch.testing.assert_close(torch.tensor(got), want, rtol=1e-5, atol=1e-6)
    killed = json.load(open(tmp_path / "killed.json"))
    assert killed["id"] == "1"
