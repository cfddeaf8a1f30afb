"""Who can reach and enter an elastic job (issue 20, items 1, 2, 6, 7, 17): real launchers, real joiners.

The store an elastic job coordinates through listens where ``--master-addr`` says
(loopback by default); a joiner must present the job's secret; a joiner admitted but
never arriving is dropped within the heartbeat timeout; a joiner arriving after the
end leaves at once with no thread left behind.
"""
from __future__ import annotations

import glob
import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

WORKER = os.path.join(os.path.dirname(__file__), "workers", "elastic.py")
CLI = [sys.executable, "-c", "import sys; from phalanx.cli import main; sys.exit(main())"]

pytestmark = pytest.mark.multiproc


def listening(port: int) -> list[str]:
    """The local addresses of every listening TCP socket (IPv4 and IPv6) on ``port``, as hex from /proc."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = open(table).read().splitlines()[1:]
        except FileNotFoundError:
            continue
        for line in lines:
            local, state = line.split()[1], line.split()[3]
            addr, _, hexport = local.partition(":")
            if state == "0A" and int(hexport, 16) == port:
                found.append(addr)
    return found


def start_job(tmp_path, *flags: str, n: int = 2, args: tuple[str, ...] = ()) -> tuple[subprocess.Popen, int]:
    """A long elastic job; returns the launcher and its store's port (read from its first line)."""
    cmd = [*CLI, "run", "-n", str(n), "--elastic", *flags, WORKER, "--out", str(tmp_path), *args]
    launcher = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
    line = launcher.stderr.readline()
    match = re.search(r"its store is at (\S+):(\d+)", line)
    assert match, line
    deadline = time.monotonic() + 90  # until the workers train: the launcher handles SIGTERM from then on
    while len(glob.glob(str(tmp_path / "training*"))) < n and time.monotonic() < deadline:
        assert launcher.poll() is None, launcher.communicate()[1][-2000:]
        time.sleep(0.1)
    return launcher, int(match.group(2))


def stop(launcher: subprocess.Popen) -> str:
    if launcher.poll() is None:
        launcher.send_signal(signal.SIGTERM)
    return launcher.communicate(timeout=60)[1]


def test_the_elastic_store_listens_on_loopback_only_by_default(tmp_path):
    launcher, port = start_job(tmp_path, "--min-workers", "1", args=("--step-sleep", "0.5", "--epochs", "20"))
    try:
        addrs = listening(port)
        assert addrs, "nothing listens on the port the launcher printed"
        loopback = {"0100007F", "00000000000000000000000001000000"}  # 127.0.0.1, ::1
        assert set(addrs) <= loopback, addrs
    finally:
        stop(launcher)
