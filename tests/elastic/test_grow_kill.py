"""A worker lost while the group grows for a joiner: the others regroup and train on; nothing wedges.

``phalanx run -n 2 --elastic --max-workers 3`` trains ``tests/workers/elastic.py``; once both
workers train, ``phalanx join`` adds a third (the two wait for it: ``--wait-for-joiner``).
At the next commit point the members and the joiner form the grown generation; one of them
stops inside that rebuild (``--hold-in-grow`` writes ``holding<ID>.json`` there) and the test
kills it with SIGKILL at that marker: the others are then forming the generation with a peer
that will never come.

The bound on each job is derived from the heartbeat timeout; the collective timeout is set far
above it, so a wait that does not consult who is known dead shows up as a job that never ends.
"""
from __future__ import annotations

import glob
import json
import os
import signal
import subprocess
import time

import pytest
import torch

from support.forked_launch import start_cli  # the launcher forked from this process, its workers from one server
from support.paths import TESTS
from support.procs import free_port, reap
from support.wait import until
from workers import elastic as worker

pytestmark = pytest.mark.multiproc

WORKER = os.path.join(TESTS, "workers", "elastic.py")
HEARTBEAT_S = 4.0
COLLECTIVE_S = 300  # PHALANX_TIMEOUT: far beyond the bound below, so only a wait that consults the dead ends in time
EPOCHS = 1
# each phase's bound, counted from its own start (the members' start-up, the joiner's, the kill): a process start-up
# and training on a loaded 2-core machine, plus the loss: found by the watcher at once, at worst by a stopped
# heartbeat, then one quorum wait (heartbeat + 10 s) and one admission wait (heartbeat)
BOUND_S = 90 + 4 * HEARTBEAT_S + 10


def run_grow_kill(tmp_path, victim: str) -> tuple[int, str, dict, dict]:
    """Start the job, add a joiner, kill ``victim`` (an id prefix) inside the grow; returns (rc, stderr, results,
    what the marker said)."""
    port = free_port()
    env = {"PHALANX_SECRET": "5a" * 32, "PHALANX_TIMEOUT": str(COLLECTIVE_S)}
    flags = [WORKER, "--out", str(tmp_path), "--epochs", str(EPOCHS), "--commit-every", "2",
             "--wait-for-joiner", "--hold-in-grow", victim]
    err_path = tmp_path / "launcher.err"
    (tmp_path / "join").mkdir()  # the joiner's launcher.err
    started = time.monotonic()
    launcher = start_cli(["run", "-n", "2", "--elastic", "--min-workers", "1", "--max-workers", "3",
                          "--heartbeat-timeout", str(HEARTBEAT_S), "--master-port", str(port), *flags],
                         str(tmp_path), env=env)
    joiner, held = None, {}
    try:
        # the joiner asks once both members train (markers written at their first step)
        until(lambda: all(os.path.exists(tmp_path / f"training{w}") for w in "01"), timeout=BOUND_S,
              what="both workers training", procs=[launcher], detail=lambda: err_path.read_text()[-3000:])
        joiner = start_cli(["join", "--rdzv-endpoint", f"127.0.0.1:{port}", "-n", "1", *flags], str(tmp_path / "join"),
                           env=env)
        started = time.monotonic()  # the joiner's start-up: a phase of its own
        markers = str(tmp_path / f"holding{victim}*.json")  # the victim's id starts with `victim`
        until(lambda: glob.glob(markers), timeout=max(1.0, BOUND_S - (time.monotonic() - started)),
              what=f"worker {victim} inside the grow", procs=[launcher],
              detail=lambda: err_path.read_text()[-3000:])
        held = json.load(open(glob.glob(markers)[0]))
        os.kill(held["pid"], signal.SIGKILL)  # inside the grow: the others are forming the generation
        held["killed"] = time.time()
        started = time.monotonic()  # what is under test: the end after the kill
        launcher.wait(timeout=max(1.0, BOUND_S - (time.monotonic() - started)))
        joiner.wait(timeout=30)
    except subprocess.TimeoutExpired:
        pass
    finally:
        reap(launcher, joiner)
    stderr = err_path.read_text() + (tmp_path / "join" / "launcher.err").read_text()
    assert launcher.returncode is not None and launcher.returncode >= 0, \
        f"the job did not end within {BOUND_S:.0f}s of the kill (wedged):\n{stderr[-4000:]}"
    results = {json.load(open(p))["id"]: json.load(open(p)) for p in glob.glob(str(tmp_path / "worker*.json"))}
    return launcher.returncode, stderr, results, held


def check_trained_once(results: dict, survivors: set[str]) -> None:
    """Every survivor ends with the same record: each sample once per epoch, and the one-process oracle's model."""
    assert survivors <= set(results), sorted(results)
    record = results[min(survivors)]["record"]
    assert all(results[w]["record"] == record for w in survivors)
    for epoch in range(EPOCHS):
        ids = [i for e, _, step in record for i in step if e == epoch]
        assert ids == torch.randperm(worker.N, generator=torch.Generator().manual_seed(epoch)).tolist()
    want = worker.oracle(record)
    for w in survivors:
        for got, expected in zip(results[w]["params"], want, strict=True):
            torch.testing.assert_close(torch.tensor(got), expected, rtol=1e-5, atol=1e-6)


def test_a_member_killed_while_the_group_grows_for_a_joiner_leaves_the_others_training(tmp_path):
    rc, stderr, results, held = run_grow_kill(tmp_path, victim="1")
    assert rc == 0, stderr[-4000:]
    assert "1" not in results and "0" in results
    check_trained_once(results, {"0"})
    after = [h for h in results["0"]["history"] if h["time"] >= held["killed"]]
    assert any("1" in h["left"] for h in after), results["0"]["history"]  # the survivors regrouped without it
    assert "Traceback" not in stderr, stderr[-4000:]


def test_the_joiner_killed_while_the_group_grows_leaves_the_members_training(tmp_path):
    rc, stderr, results, held = run_grow_kill(tmp_path, victim="j")
    assert rc == 0, stderr[-4000:]
    assert sorted(results) == ["0", "1"]
    check_trained_once(results, {"0", "1"})
    assert all(h["world_size"] <= 2 for r in results.values() for h in r["history"])  # it never entered
    assert "Traceback" not in stderr, stderr[-4000:]
