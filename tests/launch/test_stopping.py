"""launch/stopping.py: the launcher passes SIGTERM/SIGUSR1 on to its workers and keeps every worker's exit status.

A CI run of tests/launch/test_slurm.py (1 in 10 here under load): node 2's worker heard SLURM's SIGUSR1 after the
workers had trained to the end of the script; they ended normally (exit 0), but torch's handling had raised out of
its agent's loop and dropped their statuses, so `phalanx run` said "received SIGUSR1; stopped all workers" and
exited 138: SLURM marked the finished job FAILED.
"""
from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from typing import Iterator

import pytest

from phalanx.launch.stopping import Stopping, leads_its_group
from support.forked_launch import start_cli
from support.paths import REPO, TESTS
from support.wait import until

WORKER = os.path.join(TESTS, "workers", "preempt.py")
PYTHONPATH = os.pathsep.join([os.path.join(REPO, "src"), os.environ.get("PYTHONPATH", "")])

# A worker stand-in: it writes which signal it got (or nothing) and goes on waiting; with "ignore" it never ends
# on its own, so only the grace's SIGKILL ends it.
_CHILD = """
import os, signal, sys
out, mode = sys.argv[1], sys.argv[2]
def heard(signum, frame):
    with open(out, "w") as f:
        f.write(str(signum))
    if mode == "exit":
        os._exit(75)
signal.signal(signal.SIGTERM, heard); signal.signal(signal.SIGUSR1, heard)
open(out + ".ready", "w").close()
while True:
    signal.pause()
"""


@contextlib.contextmanager
def _stopping(tmp_path, mode: str, *, n: int = 2, nproc: int = 2, grace_s: float = 600) -> Iterator[tuple]:
    """``n`` worker stand-ins (each leading its own process group, as torch's agent starts workers) and the handler
    that stops them; every one of them ends with the test."""
    procs = [subprocess.Popen([sys.executable, "-c", _CHILD, str(tmp_path / f"w{i}"), mode], start_new_session=True)
             for i in range(n)]
    stop = Stopping(lambda: [p.pid for p in procs], nproc=nproc, grace_s=grace_s)
    try:
        for i, p in enumerate(procs):
            until(lambda i=i: os.path.exists(tmp_path / f"w{i}.ready"), timeout=60, what=f"child {i}", procs=[p])
        yield procs, stop
    finally:
        stop.ended()
        for p in procs:
            p.kill()
            p.wait()


def test_the_first_signal_goes_to_every_worker_and_a_repeat_to_none(tmp_path):
    with _stopping(tmp_path, "exit") as (procs, stop):
        assert all(leads_its_group(p.pid) for p in procs)
        stop(signal.SIGUSR1, None)
        assert [p.wait(timeout=60) for p in procs] == [75, 75]  # each heard it and ended as a preempted worker
        assert [open(tmp_path / f"w{i}").read() for i in range(2)] == [str(int(signal.SIGUSR1))] * 2
        assert stop.first == signal.SIGUSR1 and stop.forwarded and not stop.killed
        stop(signal.SIGTERM, None)  # a repeat: nothing to add
        assert stop.first == signal.SIGUSR1


def test_workers_still_running_when_the_grace_runs_out_are_killed(tmp_path):
    with _stopping(tmp_path, "ignore", grace_s=0.2) as (procs, stop):
        stop(signal.SIGTERM, None)
        assert [p.wait(timeout=60) for p in procs] == [-signal.SIGKILL] * 2  # heard it, did not end: killed
        assert stop.killed


def test_the_grace_also_kills_a_worker_started_after_the_signal(tmp_path):
    # --max-restarts: torch's agent may start the group again after a worker failed while stopping; the new worker
    # never heard the signal, and would have trained on past the grace
    with _stopping(tmp_path, "ignore", n=3, nproc=2) as (procs, stop):
        started = procs[:2]
        stop.workers = lambda: [p.pid for p in started]
        stop(signal.SIGTERM, None)
        started.append(procs[2])  # the restart, after the signal
        assert stop._timer is not None
        stop._timer.cancel()
        stop._timer.function(*stop._timer.args)  # the grace runs out now
        assert [p.wait(timeout=60) for p in procs] == [-signal.SIGKILL] * 3


def test_nothing_is_killed_once_the_workers_ended(tmp_path):
    with _stopping(tmp_path, "ignore", grace_s=0.5) as (procs, stop):
        stop(signal.SIGTERM, None)
        stop.ended()  # the job ended inside its grace (the launcher's cleanup): the timer must not fire
        assert stop._timer is not None
        stop._timer.join(timeout=60)
        assert not stop.killed and all(p.poll() is None for p in procs)


def test_a_signal_while_the_workers_start_goes_to_torchs_agent(tmp_path):
    from torch.distributed.elastic.multiprocessing.api import SignalException
    with _stopping(tmp_path, "ignore", n=1) as (procs, stop):  # one of two started
        with pytest.raises(SignalException):
            stop(signal.SIGUSR1, None)
        assert not stop.forwarded and not os.path.exists(tmp_path / "w0")


@pytest.mark.multiproc
def test_a_signal_the_workers_hear_after_their_training_ended_ends_the_job_complete_not_failed(tmp_path):
    # Both workers trained to the end and saved, then wait for the signal (--wait-at-end): it stops nothing, and
    # they end normally. Before: "received SIGTERM; stopped all workers", exit 143.
    out = str(tmp_path / "model.pt")
    job = start_cli(["run", "-n", "2", "--checkpoint-dir", str(tmp_path / "ckpt"), WORKER, out, "--wait-at-end"],
                    str(tmp_path), {"PYTHONPATH": PYTHONPATH})
    try:
        for rank in (0, 1):
            until(lambda rank=rank: os.path.exists(f"{out}.end-{rank}"), timeout=120, what=f"rank {rank}'s end",
                  procs=[job], detail=lambda: open(job.paths[1]).read())
        os.kill(job.pid, signal.SIGTERM)
        err = job.communicate(timeout=120)[1]
    finally:
        if job.poll() is None:
            job.kill()
    assert job.returncode == 0, err
    assert "received SIGTERM, but the workers reached the end of the script" in err and "job is complete" in err, err
    assert os.path.exists(out) and not os.path.exists(tmp_path / "ckpt")
