"""A worker whose launcher is gone ends within the heartbeat timeout: a SIGKILLed `phalanx run` (or `phalanx join`)
leaves no orphans.

Real processes: the launcher is killed with SIGKILL (it can do nothing about it), and the test waits on
pidfds of its workers (readable once a process has exited), bounded by the heartbeat timeout.
(`phalanx run --elastic`: tests/test_elastic.py::test_losing_the_launcher_ends_every_worker_with_one_line.)
"""
from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time

from datetime import timedelta

import pytest

from phalanx.elastic.options import DEFAULT_HEARTBEAT_S

CLI = [sys.executable, "-c", "import sys; from phalanx.cli import main; sys.exit(main())"]

# "Training" is a collective a step, as a wrapped model's step is: the workers are busy with each other when their
# launcher goes. (A torch optimizer would cost each worker a second of CPU importing torch._dynamo, and change nothing
# here: the watch on the launcher is px.init()'s thread, whatever the main thread runs.)
SCRIPT = """\
import json, os, sys, time
import torch, phalanx as px

px.init()
sys.stdout.write(json.dumps({"ready": px.rank(), "pid": os.getpid()}) + "\\n")
sys.stdout.flush()
started = time.monotonic()
while time.monotonic() - started < 300:  # "training" far longer than the test waits
    px.Comm().all_reduce_([torch.ones(2)], op="sum")
"""


def wait_exited(pids: list[int], timeout_s: float) -> list[int]:
    """Wait (bounded) for processes that are not our children to exit; returns those still running."""
    fds = {}
    for pid in pids:
        try:
            fds[os.pidfd_open(pid)] = pid
        except ProcessLookupError:
            continue  # already gone and reaped
    deadline = time.monotonic() + timeout_s
    try:
        while fds and time.monotonic() < deadline:
            ready, _, _ = select.select(list(fds), [], [], max(0.0, deadline - time.monotonic()))
            for fd in ready:
                os.close(fd)
                del fds[fd]
        return sorted(fds.values())
    finally:
        for fd in fds:
            os.close(fd)


@pytest.mark.multiproc
def test_workers_of_a_sigkilled_launcher_end_within_the_heartbeat_timeout(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    launcher = subprocess.Popen([*CLI, "run", "-n", "2", str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True)
    pids: list[int] = []
    try:
        while len(pids) < 2:  # each worker says when it trains, with its pid
            line = launcher.stdout.readline()
            assert line, f"the launcher ended early: {launcher.wait()} {launcher.stderr.read()[-3000:]}"
            if line.startswith('{"ready"'):
                pids.append(json.loads(line)["pid"])
        launcher.send_signal(signal.SIGKILL)
        launcher.wait(timeout=30)
        left = wait_exited(pids, DEFAULT_HEARTBEAT_S)
        assert left == [], f"workers {left} train on without their launcher"
        stderr = launcher.stderr.read()  # at EOF: every worker, holder of the inherited pipe, is gone
        lines = [ln for ln in stderr.splitlines() if "its launcher (pid " in ln]
        assert len(lines) == 2 and all("is gone; stopping" in ln for ln in lines), stderr[-3000:]
    finally:
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)  # red: the orphans must not outlive the test
            except ProcessLookupError:
                pass
        if launcher.poll() is None:
            launcher.kill()


JOINER = """\
import json, os, sys
sys.stdout.write(json.dumps({"pid": os.getpid()}) + "\\n")
sys.stdout.flush()
import phalanx as px
px.init()  # a joiner waits here to be admitted: this job never admits anyone
"""


@pytest.mark.multiproc
def test_joiners_of_a_sigkilled_phalanx_join_end_within_the_heartbeat_timeout(tmp_path):
    import torch.distributed as dist

    from phalanx.elastic import secret as job_secret
    from phalanx.elastic.membership import key
    secret = "0123456789abcdef" * 4
    # the job's store, as `phalanx run --elastic` publishes it: alive for the whole test, so its loss is not the signal
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=120))
    nonce = job_secret.nonce()
    store.set(key("config"), json.dumps({"min_workers": 1, "max_workers": 3, "heartbeat_s": DEFAULT_HEARTBEAT_S,
                                         "workers": 2, "spares": [], "nonce": nonce,
                                         "check": job_secret.verifier(secret, nonce)}))
    store.set(key("gen", 0, "members"), json.dumps(["0", "1"]))
    script = tmp_path / "join.py"
    script.write_text(JOINER)
    join = subprocess.Popen([*CLI, "join", "--rdzv-endpoint", f"127.0.0.1:{store.port}", "-n", "1", str(script)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PHALANX_SECRET": secret})
    pid = None
    try:
        line = join.stdout.readline()
        assert line, f"`phalanx join` ended early: {join.wait()} {join.stderr.read()[-3000:]}"
        pid = json.loads(line)["pid"]
        store.wait([key("joiners")])  # it asked to join: px.init() runs, waiting for its place
        join.send_signal(signal.SIGKILL)
        join.wait(timeout=30)
        assert wait_exited([pid], DEFAULT_HEARTBEAT_S) == [], "the joiner waits on without its `phalanx join`"
        assert "its launcher (pid " in join.stderr.read()
    finally:
        if pid is not None:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if join.poll() is None:
            join.kill()
