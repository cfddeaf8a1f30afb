"""A joiner admitted at the regroup where a shard died with its only holder loads the checkpoint with the survivors.

FSDP over 2 workers (one replica group, R = 1), ``px.elastic.State(checkpoint=DIR)`` writing at every
commit, and a parked spare. Worker 1 is killed before step 5 (``tests/workers/elastic.py`` waits until
the spare is parked first): its shard exists nowhere in memory, so the survivor rolls back to the
checkpoint's commit and loads its shards from disk; the spare admitted at that regroup takes the same
commit from rank 0 and loads its shards from the checkpoint too, instead of ending with ``ShardLostError``.
"""
from __future__ import annotations

import pytest
import torch

from support.elastic_job import oracle
from support.forked_launch import launch  # the launcher forked from this process, its workers from one server


@pytest.mark.multiproc
def test_a_spare_admitted_where_a_shard_was_lost_loads_the_checkpoint_with_the_survivor(tmp_path):
    proc, results = launch(tmp_path, "--min-workers", "1", "--spares", "1", "--", "--shard", "2", "--kill", "1@5",
                           "--commit-every", "3", "--epochs", "1", "--checkpoint", str(tmp_path / "ckpt"), n=2,
                           timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "shard 1 of 2 of the commit died with its only holder; the model and optimizer of step 3 come from" \
        in proc.stderr
    assert sorted(results) == ["0", "s0"], proc.stderr[-3000:]
    assert [(h["left"], h["joined"], h["step"]) for h in results["0"]["history"]] == [(["1"], ["s0"], 3)]
    record = results["0"]["record"]
    assert results["s0"]["record"] == record and [w for _, w, _ in record] == [2] * len(record)
    for r in results.values():
        for got, want in zip(r["params"], oracle(record), strict=True):
            torch.testing.assert_close(torch.tensor(got), want, rtol=1e-5, atol=1e-6)
