"""Elastic commits stay correct when one rank's step is skipped, or when rank 0 dies inside a commit.

Real workers under ``phalanx run --elastic``, real deaths (SIGKILL, an exit inside the
commit). The survivors' records say which samples the whole group trained on at every
step, rolled back with the commits; the oracle retrains one process on exactly those
global batches (``tests/workers/elastic_commit.py``).
"""
from __future__ import annotations

import glob
import json
import os
import subprocess
import sys

import pytest

from workers import elastic as base
from workers import elastic_commit as worker
from support.elastic_job import check_each_epoch_whole, check_oracle
from support.paths import TESTS
from support.forked_launch import run_cli

WORKER = os.path.join(TESTS, "workers", "elastic_commit.py")
CLI = [sys.executable, "-c", "import sys; from phalanx.cli import main; sys.exit(main())"]


def launch(tmp_path, *worker_flags: str, n: int = 3, script: str = WORKER, timeout: float = 150,
           env: dict | None = None) -> tuple[subprocess.CompletedProcess, dict]:
    argv = ["run", "-n", str(n), "--elastic", "--min-workers", "2", script, "--out", str(tmp_path), *worker_flags]
    proc = run_cli(argv, str(tmp_path), timeout, env=env)  # the launcher forked from here, its workers from one server
    results = {json.load(open(p))["id"]: json.load(open(p)) for p in glob.glob(str(tmp_path / "worker*.json"))}
    return proc, results


def check_survivors_match_the_oracle(proc, results, lost: str, rolled_back_to: int) -> list:
    """Exit 0; the survivors agree on every step; every sample once per epoch; the one-process oracle."""
    assert proc.returncode == 0, proc.stderr[-3000:]
    survivors = sorted(set("012") - {lost})
    assert sorted(results) == survivors, proc.stderr[-3000:]
    record = results[survivors[0]]["record"]
    for r in results.values():
        assert r["record"] == record and r["world_size"] == 2
        assert [(h["left"], h["step"]) for h in r["history"]] == [([lost], rolled_back_to)]
    check_each_epoch_whole(record)
    worlds = [row[1] for row in record]
    assert worlds == [3] * rolled_back_to + [2] * (len(worlds) - rolled_back_to)
    check_oracle(results, worker.oracle(record))
    return record


@pytest.mark.multiproc
def test_a_step_skipped_by_one_ranks_grad_scaler_keeps_every_rank_on_one_step_count(tmp_path):
    # Step 2 is skipped by worker 1's GradScaler only, step 5 by worker 0's (rank 0, who decides the commits) only:
    # one job for both, each skip by one rank alone. Commits every 3 steps (3, 6), worker 2 dies before step 8: the
    # survivors roll back to the commit of step 6, which every rank took at the same step.
    proc, results = launch(tmp_path, "--skip", "1@2,0@5", "--kill", "2@8")
    record = check_survivors_match_the_oracle(proc, results, "2", rolled_back_to=6)
    assert [i for i, row in enumerate(record, 1) if row[3]] == [2, 5]
    for r in results.values():  # the framework's step counts the skipped step too, on every rank
        assert all(step == taken for step, taken in r["steps_at"])


@pytest.fixture(scope="module")
def rank_0_dies_in_two_commits(tmp_path_factory) -> tuple[subprocess.CompletedProcess, dict]:
    """One job of 4 for both places: worker 0 (rank 0) exits inside the commit of step 3, the job's first; then
    worker 1, rank 0 of the regrouped 3, inside the commit of step 6."""
    out = tmp_path_factory.mktemp("die_in_commit")
    return launch(out, "--die-in-commit", "0@3,1@6", n=4, env={"PHALANX_START_METHOD": "forkserver"})


@pytest.mark.multiproc
@pytest.mark.parametrize("at", [3, 6])
def test_rank_0_killed_inside_a_commit_the_others_roll_back_and_go_on(rank_0_dies_in_two_commits, at):
    # Rank 0 (who used to decide admissions alone) exits while it captures the commit of step `at`.
    # The others finished that commit, so it is the newest one they all hold.
    proc, results = rank_0_dies_in_two_commits
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sorted(results) == ["2", "3"], proc.stderr[-3000:]
    record = results["2"]["record"]
    for r in results.values():
        assert r["record"] == record and r["world_size"] == 2
        assert [(h["left"], h["step"]) for h in r["history"]] == [(["0"], 3), (["1"], 6)]
        dead = next(h for h in r["history"] if h["step"] == at)
        assert dead["was"] == (4 if at == 3 else 3) and dead["left"] == [str(at // 3 - 1)]  # rank 0 at that commit
    check_each_epoch_whole(record)
    assert [row[1] for row in record] == [4] * 3 + [3] * 3 + [2] * (len(record) - 6)
    check_oracle(results, worker.oracle(record))
    assert "DistStoreError" not in proc.stderr


LOOP = os.path.join(TESTS, "workers", "elastic_loop.py")


def test_the_module_level_loop_runs_plainly_outside_phalanx_run(tmp_path):
    subprocess.run([sys.executable, LOOP, "--out", str(tmp_path)], check=True, timeout=120)
    result = json.load(open(tmp_path / "worker0.json"))
    assert [row[1] for row in result["record"]] == [1] * 32 and result["history"] == []
    check_oracle({"0": result}, base.oracle(result["record"]))


@pytest.mark.multiproc
def test_a_module_level_loop_survives_a_kill_and_matches_the_oracle(tmp_path):
    # `for epoch in state.epochs(n): with state:` and no training function; worker 1 dies before step 5,
    # the survivors roll back to the commit of step 3 and go on from there, mid-epoch.
    proc, results = launch(tmp_path, "--kill", "1@5", script=LOOP)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sorted(results) == ["0", "2"]
    record = results["0"]["record"]
    for r in results.values():
        assert r["record"] == record and r["world_size"] == 2
        assert [(h["left"], h["step"]) for h in r["history"]] == [(["1"], 3)]
    check_each_epoch_whole(record)
    assert [row[1] for row in record] == [3] * 3 + [2] * (len(record) - 3)
    check_oracle(results, base.oracle(record))
