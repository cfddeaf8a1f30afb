"""A worker SIGKILLed while the group writes a checkpoint is a lost peer: the save is abandoned, the job goes on.

``px.elastic.State(checkpoint=DIR)`` writes the checkpoint at every commit (every 3 steps). At the
save of step 6 one worker holds at a marked place (``tests/workers/elastic_kill_save.py``) and the
test kills it there with SIGKILL: before it enters the save, inside DCP's write, or (rank 0) after
the write, before the directory is put in place. The survivors regroup from the commit of step 6,
train on and match the one-process oracle; the checkpoint on disk is always a whole one, and no
temporary directory is left. The launcher's timeout is raised to 600 s: a survivor that waited for
the dead worker until its timeout, instead of asking who is dead, would not finish in this test's time.
"""
from __future__ import annotations

import glob
import json
import os
import signal
import subprocess

import pytest
import torch

from phalanx.checkpoint import checkpoint_step
from support.elastic_job import CLI
from support.paths import TESTS
from support.wait import until
from workers.elastic import N
from workers import elastic_commit

WORKER = os.path.join(TESTS, "workers", "elastic_kill_save.py")
WAIT_S = 120  # for the marker, then for the job: generous on a loaded 2-core machine, far below the 600 s timeout


def run_and_kill_at_marker(tmp_path, victim: str, where: str) -> tuple[int, str, dict]:
    ckpt = tmp_path / "ckpt"
    cmd = [*CLI, "run", "-n", "3", "--elastic", "--min-workers", "2", WORKER, "--out", str(tmp_path),
           "--ckpt", str(ckpt), "--hold", f"{victim}@{where}"]
    env = {**os.environ, "PHALANX_TIMEOUT": "600"}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)  # its own process group: a failed test ends every worker
    marker = tmp_path / "holding.json"
    try:
        # the worker writes it where it holds: an event, not a guess at timing
        until(marker.exists, timeout=WAIT_S, what="the victim holding in the save", procs=[proc])
        held = json.loads(marker.read_text())
        assert held["id"] == victim
        os.kill(held["pid"], signal.SIGKILL)
        out, err = proc.communicate(timeout=WAIT_S)
    finally:
        if proc.returncode is None:
            os.killpg(proc.pid, signal.SIGKILL)  # the launcher and its workers (they hold its pipes)
            proc.communicate()
    results = {json.load(open(p))["id"]: json.load(open(p)) for p in glob.glob(str(tmp_path / "worker*.json"))}
    return proc.returncode, err, results


@pytest.mark.multiproc
@pytest.mark.parametrize("victim,where", [("1", "write"), ("2", "enter"), ("0", "commit")])
def test_a_worker_killed_during_a_checkpoint_save_is_a_lost_peer_and_the_job_goes_on(tmp_path, victim, where):
    code, err, results = run_and_kill_at_marker(tmp_path, victim, where)
    assert code == 0, err[-3000:]
    survivors = sorted(set("012") - {victim})
    assert sorted(results) == survivors, err[-3000:]
    record = results[survivors[0]]["record"]
    for r in results.values():  # one regroup, at the commit of step 6 that every survivor holds: nothing redone
        assert r["record"] == record and r["world_size"] == 2
        assert [(h["left"], h["step"], h["redone_steps"]) for h in r["history"]] == [([victim], 6, 0)]
        assert "WorkerLostError" in r["history"][0]["cause"]
    for epoch in (0, 1):  # every sample once per epoch
        ids = [i for row in record if row[0] == epoch for i in row[2]]
        assert ids == torch.randperm(N, generator=torch.Generator().manual_seed(epoch)).tolist()
    assert [row[1] for row in record] == [3] * 6 + [2] * (len(record) - 6)
    for r in results.values():
        for got, want in zip(r["params"], elastic_commit.oracle(record), strict=True):
            torch.testing.assert_close(torch.tensor(got), want, rtol=1e-5, atol=1e-6)
    # The checkpoint is whole and holds the last commit's step; the abandoned save left no temporary behind.
    assert checkpoint_step(str(tmp_path / "ckpt")) == (results[survivors[0]]["step"] - 1) // 3 * 3
    assert glob.glob(str(tmp_path / "ckpt.tmp-*")) == []
    assert "CheckpointError" not in err
