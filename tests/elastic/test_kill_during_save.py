"""A worker SIGKILLed while the group writes a checkpoint is a lost peer: the save is abandoned, the job goes on.

``px.elastic.State(checkpoint=DIR)`` writes the checkpoint at every commit (every 3 steps). One job of
5 workers serves the four places a kill can land: at the save of step 3 worker 4 is killed once its part
reached rank 0, while rank 0 writes DCP's metadata (rank 0's last answer then fails on it, and the others
either hold that answer and wait for rank 0's word on the rename, or still wait for the answer itself); at
the save of step 6 worker 1 holds inside DCP's write, at the save of step 9 worker 2 holds before it enters
the save, and at the save of step 12 worker 0 (rank 0) holds after the write, before the directory is put
in place (``tests/workers/elastic_kill_save.py``); the test kills each with SIGKILL at its marker. After each
loss the survivors regroup from the commit of that step (nothing redone), train on and, at the end,
match the one-process oracle; the checkpoint on disk is always a whole one, and no temporary directory
is left. The launcher's timeout is raised to 600 s: a survivor that waited for the dead worker (or for
rank 0's word) until its timeout, instead of asking who is dead, would not finish in this test's time.
"""
from __future__ import annotations

import glob
import json
import os
import signal
from pathlib import Path

import pytest

from phalanx.checkpoint import checkpoint_step
from support.elastic_job import check_each_epoch_whole, check_oracle
from support.forked_launch import start_cli  # the launcher forked from this process, its workers from one server
from support.paths import TESTS
from support.wait import until
from workers import elastic_commit

WORKER = os.path.join(TESTS, "workers", "elastic_kill_save.py")
WAIT_S = 120  # for each marker, then for the job: generous on a loaded 2-core machine, far below the 600 s timeout
# in the order they land: world 5, 4, 3, then 2
KILLS = [("4", "finish", 3), ("1", "write", 6), ("2", "enter", 9), ("0", "commit", 12)]


@pytest.fixture(scope="module")
def killed_during_saves(tmp_path_factory) -> tuple[int, str, dict, Path]:
    """The job, each of KILLS placed at its marker in turn; (exit status, stderr, results, out)."""
    out = tmp_path_factory.mktemp("kill_save")
    argv = ["run", "-n", "5", "--elastic", "--min-workers", "1", WORKER, "--out", str(out),
            "--ckpt", str(out / "ckpt"), "--epochs", "3", "--hold", ",".join(f"{v}@{w}@{at}" for v, w, at in KILLS)]
    proc = start_cli(argv, str(out), env={"PHALANX_TIMEOUT": "600", "PHALANX_START_METHOD": "forkserver"})
    try:
        for victim, where, _ in KILLS:
            marker = out / f"holding{victim}.json"
            # the worker writes it where it holds: an event, not a guess at timing
            until(marker.exists, timeout=WAIT_S, what=f"worker {victim} holding in the save", procs=[proc])
            held = json.loads(marker.read_text())
            assert held["id"] == victim
            if where == "finish":  # the victim's result reached rank 0, which holds in DCP's finish
                until((out / "finishing.json").exists, timeout=WAIT_S, what="rank 0 in DCP's finish", procs=[proc])
            os.kill(held["pid"], signal.SIGKILL)
            if where == "finish":  # its sockets are closed once it is dead (a zombie holds none): rank 0 goes on
                until(lambda pid=held["pid"]: _dead(pid), timeout=WAIT_S, what=f"worker {victim} dead")
                (out / "killed").write_text("")
        _, err = proc.communicate(timeout=WAIT_S)
    finally:
        if proc.returncode is None:
            proc.kill()  # a failed test: its workers end once they see their launcher gone (phalanx.group.orphan)
            proc.wait()
    results = {json.load(open(p))["id"]: json.load(open(p)) for p in glob.glob(str(out / "worker*.json"))}
    return proc.returncode, err, results, out


def _dead(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True


@pytest.mark.multiproc
@pytest.mark.parametrize("victim,where,at", KILLS, ids=[f"{v}-{w}" for v, w, _ in KILLS])
def test_a_worker_killed_during_a_checkpoint_save_is_a_lost_peer_and_the_job_goes_on(killed_during_saves, victim,
                                                                                      where, at):
    code, err, results, out = killed_during_saves
    assert code == 0, err[-3000:]
    assert sorted(results) == ["3"], err[-3000:]  # the one worker never held
    [survivor] = results.values()
    record = survivor["record"]
    # one regroup per kill, at the commit of the step whose save it broke, which every survivor holds: nothing redone
    assert [(h["left"], h["step"], h["redone_steps"]) for h in survivor["history"]] == \
        [([v], s, 0) for v, _, s in KILLS]
    mine = next(h for h in survivor["history"] if h["left"] == [victim])
    assert (mine["step"], mine["was"]) == (at, 5 - [v for v, _, _ in KILLS].index(victim))
    assert "WorkerLostError" in mine["cause"]
    check_each_epoch_whole(record, epochs=3)
    assert [row[1] for row in record] == [5] * 3 + [4] * 3 + [3] * 3 + [2] * 3 + [1] * (len(record) - 12)
    check_oracle(results, elastic_commit.oracle(record))
    # The checkpoint is whole and holds the last commit's step; the abandoned saves left no temporary behind.
    assert checkpoint_step(str(out / "ckpt")) == (survivor["step"] - 1) // 3 * 3
    assert glob.glob(str(out / "ckpt.tmp-*")) == []
    assert "CheckpointError" not in err
