"""Elastic training with sharded state: ``phalanx run --elastic`` with ``shard=px.FullyShard(group_size=2)``.

4 workers = 2 replica groups x 2 shards (HSDP) train ``tests/workers/elastic.py``; the worker
started as rank 1 (shard 1 of group 0) is killed with SIGKILL. The 3 survivors rebuild the
group, take the lost shard from the surviving replica group and re-shard the model and the
optimizer onto themselves (1 x 3: 2 does not divide 3); the replacement that ``--replace``
starts then joins and receives its shards (2 x 2 again). With one replica group (1 x 2) the
lost shard exists nowhere in memory: the survivor reloads the checkpoint every commit wrote.
Each result equals one process trained on the same global batches (the oracle of
tests/test_elastic.py).
"""
from __future__ import annotations

import glob

import pytest
import torch

from test_elastic import launch
from workers import elastic as worker


@pytest.fixture(autouse=True)
def _spawned_workers(monkeypatch):
    """Workers start as fresh interpreters here: these runs expect the regroup after a loss to come before the
    replacement is ready; a forked replacement (PHALANX_START_METHOD=forkserver) is ready in that same regroup."""
    monkeypatch.setenv("PHALANX_START_METHOD", "spawn")


@pytest.mark.multiproc
def test_hsdp_2x2_loses_a_worker_goes_on_as_1x3_then_a_replacement_joins_as_2x2_equal_to_the_oracle(tmp_path):
    proc, results = launch(tmp_path, "--min-workers", "3", "--replace", "--", "--shard", "2", "--kill", "1@5",
                           "--commit-every", "3", "--epochs", "4", "--slow-while-below", "4", n=4, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sorted(results) == ["0", "2", "3", "r1"]
    assert "3 workers re-shard as 1 x 3" in proc.stderr
    for wid in ("0", "2", "3"):  # the same processes went on
        assert len(glob.glob(str(tmp_path / f"start{wid}-*.json"))) == 1
        assert [(h["left"], h["joined"]) for h in results[wid]["history"]] == [(["1"], []), ([], ["r1"])]
    record = results["0"]["record"]
    assert all(r["record"] == record and r["world_size"] == 4 for r in results.values())
    worlds = [w for _, w, _ in record]
    joined = worlds.index(4, 3)
    assert worlds[:4] == [4, 4, 4, 3] and set(worlds[3:joined]) == {3} and set(worlds[joined:]) == {4}
    for epoch in range(4):  # every sample once per epoch: rolled back at the loss, nothing redone at the join
        ids = [i for e, _, step in record for i in step if e == epoch]
        assert ids == torch.randperm(worker.N, generator=torch.Generator().manual_seed(epoch)).tolist()
    for r in results.values():  # the oracle: one process on the same global batches
        for got, want in zip(r["params"], worker.oracle(record), strict=True):
            torch.testing.assert_close(torch.tensor(got), want, rtol=1e-5, atol=1e-6)


@pytest.mark.multiproc
def test_fsdp_of_one_replica_group_loses_a_worker_and_the_survivor_reloads_the_checkpoint(tmp_path):
    # R = 1: the lost worker's shard exists nowhere in memory; every commit also wrote a DCP checkpoint
    proc, results = launch(tmp_path, "--min-workers", "1", "--", "--shard", "2", "--kill", "1@5", "--commit-every",
                           "3", "--epochs", "1", "--checkpoint", str(tmp_path / "ckpt"), n=2, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "shard 1 of 2 of the commit died with its only holder; the model and optimizer of step 3 come from" \
        in proc.stderr
    assert sorted(results) == ["0"] and [h["left"] for h in results["0"]["history"]] == [["1"]]
    record = results["0"]["record"]
    worlds = [w for _, w, _ in record]
    assert worlds == [2] * 3 + [1] * (len(worlds) - 3)
    for got, want in zip(results["0"]["params"], worker.oracle(record), strict=True):
        torch.testing.assert_close(torch.tensor(got), want, rtol=1e-5, atol=1e-6)
