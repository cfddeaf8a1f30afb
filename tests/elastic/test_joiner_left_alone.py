"""A joiner whose job goes away under it ends with one line: no traceback, no wait past the heartbeat timeout.

``phalanx run -n 2 --elastic`` trains ``tests/workers/elastic.py``; ``phalanx join`` adds a worker.
Two ways the job can leave that joiner alone, each with real SIGKILLs:

* every member dies while they admit the joiner: the joiner has claimed its place and waits for the
  members' answer (``gen/<g>/go``) that nobody is left to give (``--hold-in-admit`` stops the members
  there and the test kills them at their markers);
* the job ends (its members killed, no ``--replace``) while the joiner still waits for a place
  (``--max-workers 2``: none is ever offered; ``--hold-at`` keeps the members training until the
  kill), and the launcher closes the job's store under it.

The collective timeout is set far above the bound, so a wait that does not watch the dead marks, or a
store call that is not ready for the store to close, shows up as a job that does not end or a traceback.
"""
from __future__ import annotations

import glob
import json
import os
import signal
import subprocess
import time
from datetime import timedelta

import pytest

from support.forked_launch import Launcher, start_cli  # the launcher forked, its workers from one server
from support.paths import TESTS
from support.procs import free_port, reap
from support.wait import until

pytestmark = pytest.mark.multiproc

WORKER = os.path.join(TESTS, "workers", "elastic.py")
HEARTBEAT_S = 4.0
COLLECTIVE_S = 300  # PHALANX_TIMEOUT: far beyond the bound, so only a wait that consults the dead ends in time
# each phase's bound, counted from its own start (the members' start-up, the joiner's, the kill): a process start-up
# on a loaded 2-core machine, plus the loss: found by the watcher at once, at worst by a stopped heartbeat
BOUND_S = 90 + 4 * HEARTBEAT_S


def run_alone(tmp_path, run_flags: list[str], job_flags: list[str], kill_when) -> tuple[Launcher, Launcher | None]:
    """Start the job and a joiner; once ``kill_when(store, out)`` names pids, SIGKILL them; wait for both to end."""
    import torch.distributed as dist

    port = free_port()
    env = {"PHALANX_SECRET": "5a" * 32, "PHALANX_TIMEOUT": str(COLLECTIVE_S)}
    flags = [WORKER, "--out", str(tmp_path), *job_flags]
    (tmp_path / "join").mkdir()  # the joiner's launcher.err
    started = time.monotonic()
    left = lambda: max(1.0, BOUND_S - (time.monotonic() - started))  # noqa: E731 - the bound of the phase under way
    launcher = start_cli(["run", "-n", "2", "--elastic", "--min-workers", "1", "--heartbeat-timeout", str(HEARTBEAT_S),
                          "--master-port", str(port), *run_flags, *flags], str(tmp_path), env=env)
    joiner = None
    try:
        until(lambda: all(os.path.exists(tmp_path / f"training{w}") for w in "01"), timeout=left(),
              what="both workers training",
              procs=[launcher], detail=lambda: (tmp_path / "launcher.err").read_text()[-3000:])
        store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=30),
                              wait_for_workers=False)
        joiner = start_cli(["join", "--rdzv-endpoint", f"127.0.0.1:{port}", "-n", "1", *flags], str(tmp_path / "join"),
                           env=env)
        started = time.monotonic()  # the joiner's start-up: a phase of its own
        victims: list[int] = []
        until(lambda: victims.extend(kill_when(store, tmp_path) or []) or victims, timeout=left(),
              what="the moment to kill", procs=[launcher, joiner],
              detail=lambda: (tmp_path / "launcher.err").read_text()[-3000:])
        for pid in victims:
            os.kill(pid, signal.SIGKILL)
        started = time.monotonic()  # what is under test: the end after the kill
        launcher.wait(timeout=left())
        joiner.wait(timeout=left())
    except subprocess.TimeoutExpired:
        pass
    finally:
        reap(launcher, joiner)
    return launcher, joiner


def held_members(store, out) -> list[int] | None:
    """Both members, once each stopped inside the admission (their markers): the joiner claimed its place."""
    found = [glob.glob(str(out / f"holding{w}.json")) for w in "01"]
    return [json.load(open(f[0]))["pid"] for f in found] if all(found) else None


def members_once_a_joiner_waits(store, out) -> list[int] | None:
    """Both members, once the joiner asked to join (``elastic/joiners`` names it)."""
    from phalanx.elastic.membership import key

    asked = json.loads(store.get(key("joiners"))) if store.check([key("joiners")]) else []
    starts = [glob.glob(str(out / f"start{w}-*.json")) for w in "01"]
    return [json.load(open(s[0]))["pid"] for s in starts] if asked and all(starts) else None


def test_a_joiner_whose_admitting_members_all_die_ends_with_one_line(tmp_path):
    launcher, joiner = run_alone(tmp_path, ["--max-workers", "3"],
                                 ["--epochs", "1", "--commit-every", "2", "--wait-for-joiner",
                                  "--hold-in-admit", "0,1"],
                                 held_members)
    stderr = (tmp_path / "launcher.err").read_text() + (tmp_path / "join" / "launcher.err").read_text()
    assert launcher.returncode is not None and launcher.returncode >= 0, f"wedged:\n{stderr[-4000:]}"
    assert joiner.returncode is not None and joiner.returncode >= 0, f"the joiner wedged:\n{stderr[-4000:]}"
    assert "was lost while it entered generation" in stderr, stderr[-4000:]
    assert launcher.returncode != 0  # commits were in memory only: the job cannot go on without a member
    assert "Traceback" not in stderr, stderr[-4000:]


def test_a_joiner_still_waiting_when_the_job_ends_leaves_with_one_line(tmp_path):
    # the members hold before their step 3 (--hold-at, never released): the job is still running when the joiner
    # asks, however long its start-up takes, and ends by the kill
    launcher, joiner = run_alone(tmp_path, ["--max-workers", "2"], ["--epochs", "1", "--hold-at", "3"],
                                 members_once_a_joiner_waits)
    stderr = (tmp_path / "launcher.err").read_text() + (tmp_path / "join" / "launcher.err").read_text()
    assert launcher.returncode is not None and launcher.returncode >= 0, f"wedged:\n{stderr[-4000:]}"
    assert joiner.returncode == 0, stderr[-4000:]
    assert "closed before it was admitted" in stderr or "finished training" in stderr, stderr[-4000:]
    assert "Traceback" not in stderr, stderr[-4000:]
