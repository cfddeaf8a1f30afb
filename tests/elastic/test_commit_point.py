"""A membership change is decided where the user's loop shows it, never thrown out of ``opt.step()``.

With a loader other than ``px.shard`` (here the user's own iterator) the loop's commit point is its own
``state.commit()``, as in Horovod. ``phalanx run -n 2 --elastic --max-workers 3`` trains
``tests/workers/elastic_plain.py``; ``phalanx join`` adds a third worker once both train, and worker 1 is then sent
SIGTERM (a drained node). The loop wraps ``opt.step()`` in ``try/except BaseException``: nothing may come out of
it, the joiner enters and worker 1 leaves at a commit point, every sample is trained once per epoch, and the
model is the one-process oracle's.
"""
from __future__ import annotations

import glob
import json
import os
import time

import pytest
import torch

from support.forked_launch import start_cli  # the launcher forked from this process, its workers from one server
from support.paths import TESTS
from support.procs import free_port
from support.wait import exited, until
from workers import elastic_plain as worker

WORKER = os.path.join(TESTS, "workers", "elastic_plain.py")
HEARTBEAT_S = 10.0  # the launcher's default
# three start-ups and two epochs on a loaded 2-core machine, plus one admission (heartbeat) and one regroup
BOUND_S = 150 + 2 * HEARTBEAT_S


@pytest.mark.multiproc
def test_a_plain_loops_opt_step_never_raises_the_join_and_the_leave_come_out_of_state_commit(tmp_path):
    port = free_port()
    env = {"PHALANX_SECRET": "5b" * 32}
    flags = [WORKER, "--out", str(tmp_path), "--epochs", "2", "--commit-every", "2", "--term", "1@10"]
    started = time.monotonic()
    (tmp_path / "join").mkdir()  # the joiner's launcher.err
    launcher = start_cli(["run", "-n", "2", "--elastic", "--min-workers", "1", "--max-workers", "3",
                          "--master-port", str(port), *flags], str(tmp_path), env=env)
    joiner = None
    try:
        # the joiner asks once both members are in (they wait for it before their 3rd step)
        until(lambda: all(os.path.exists(tmp_path / f"training{w}") for w in "01"),
              timeout=BOUND_S, what="both workers training", procs=[launcher],
              detail=lambda: (tmp_path / "launcher.err").read_text()[-3000:])
        joiner = start_cli(["join", "--rdzv-endpoint", f"127.0.0.1:{port}", "-n", "1", *flags], str(tmp_path / "join"),
                           env=env)
        left = max(1.0, BOUND_S - (time.monotonic() - started))
        code = exited(launcher, timeout=left, what="the job")
        joined = exited(joiner, timeout=60, what="phalanx join")
    finally:
        for p in (launcher, joiner):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait()
    stderr = (tmp_path / "launcher.err").read_text() + (tmp_path / "join" / "launcher.err").read_text()
    results = {json.load(open(p))["id"]: json.load(open(p)) for p in glob.glob(str(tmp_path / "worker*.json"))}
    for r in results.values():
        assert r["raised"] == [], r["raised"]  # nothing came out of opt.step()
    assert code == 0 and joined == 0, stderr[-4000:]
    (j,) = [w for w in results if w.startswith("j")]
    assert sorted(results) == sorted(["0", j]), stderr[-4000:]  # worker 1 left; the joiner finished the job
    history = results["0"]["history"]
    assert [(h["joined"], h["left"]) for h in history] == [([j], []), ([], ["1"])]
    grew, left = history[0]["step"], history[1]["step"]
    assert history[1]["redone_steps"] == 0 and "left (preempted)" in history[1]["cause"]
    # at the loop's state.commit() (every 3rd step): the joiner, ready before step 6, at step 6; worker 1, sent
    # SIGTERM before step 10 (its notice is in the store after that step), at step 12
    assert (grew, left) == (6, 12)
    assert "worker 1 leaves the group after step 12" in stderr
    record = results["0"]["record"]
    assert results[j]["record"] == record
    worlds = [w for _, w, _ in record]
    assert worlds == [2] * grew + [3] * (left - grew) + [2] * (len(worlds) - left)
    for epoch in range(2):  # every sample exactly once per epoch
        ids = [i for e, _, step in record for i in step if e == epoch]
        assert ids == torch.randperm(worker.N, generator=torch.Generator().manual_seed(epoch)).tolist()
    want = worker.oracle(record)
    for r in results.values():
        for got, param in zip(r["params"], want, strict=True):
            torch.testing.assert_close(torch.tensor(got), param, rtol=1e-5, atol=1e-6)


@pytest.mark.multiproc
def test_a_loop_that_never_calls_commit_lets_a_signalled_worker_leave_at_an_automatic_commit(tmp_path):
    """No state.commit() in the loop: the worker sent SIGTERM ends its own process at the next automatic commit
    (nothing out of opt.step()); the other meets it gone, redoes nothing, and finishes equal to the oracle."""
    port = free_port()
    launcher = start_cli(["run", "-n", "2", "--elastic", "--min-workers", "1", "--master-port", str(port), WORKER,
                          "--out", str(tmp_path), "--epochs", "2", "--commit-every", "2", "--term", "1@10",
                          "--no-commit"], str(tmp_path))
    try:
        code = exited(launcher, timeout=BOUND_S, what="the job")
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
    stderr = (tmp_path / "launcher.err").read_text()
    results = {json.load(open(p))["id"]: json.load(open(p)) for p in glob.glob(str(tmp_path / "worker*.json"))}
    assert code == 0 and sorted(results) == ["0"], stderr[-4000:]
    assert results["0"]["raised"] == []
    (change,) = results["0"]["history"]
    # SIGTERM before step 10: its notice is in the store after step 10, the commit of step 10 is the next
    assert change["left"] == ["1"] and change["redone_steps"] == 0 and change["step"] == 10, change
    assert "worker 1 leaves the group after step 10" in stderr
    record = results["0"]["record"]
    for epoch in range(2):  # every sample exactly once per epoch
        ids = [i for e, _, step in record for i in step if e == epoch]
        assert ids == torch.randperm(worker.N, generator=torch.Generator().manual_seed(epoch)).tolist()
    for got, param in zip(results["0"]["params"], worker.oracle(record), strict=True):
        torch.testing.assert_close(torch.tensor(got), param, rtol=1e-5, atol=1e-6)
