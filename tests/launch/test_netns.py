"""The rate-limited link: two network namespaces, a veth pair, tc tbf; always torn down.

These need root, `ip` and `tc`; without them they skip and say why.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest
from conftest import needs_root_netns

from phalanx.launch import netns
from phalanx.launch.workers import start_worker
from support.procs import reap
from support.wait import until
from phalanx.bench.runner import config_for, launch, Options
from phalanx.bench.spec import Run, Setup

pytestmark = [pytest.mark.netns, needs_root_netns()]

RECEIVER = """
import socket, sys, time
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); s.bind((sys.argv[1], 5601)); s.listen(1)
print("ready", flush=True)
c, _ = s.accept(); n = 0; t = None
while True:
    d = c.recv(1 << 20)
    if not d: break
    t = t or time.perf_counter(); n += len(d)
print(n * 8 / (time.perf_counter() - t) / 1e6, flush=True)
"""
SENDER = "import socket, sys; s = socket.create_connection((sys.argv[1], 5601)); s.sendall(b'x' * (4 << 20)); s.close()"


def test_the_link_is_shaped_and_torn_down():
    with netns.Link("50mbit") as link:
        assert link.exists()
        rx = subprocess.Popen(link.prefix(0) + [sys.executable, "-c", RECEIVER, link.addresses[0]],
                              stdout=subprocess.PIPE, text=True)
        assert rx.stdout.readline().strip() == "ready"
        subprocess.run(link.prefix(1) + [sys.executable, "-c", SENDER, link.addresses[0]], check=True, timeout=30)
        mbit = float(rx.stdout.readline())
        rx.wait(timeout=10)
        assert 15 < mbit < 55, f"{mbit:.1f} Mbit/s through a 50mbit tbf"
    assert not link.exists()


def test_torn_down_after_an_exception():
    with pytest.raises(RuntimeError, match="boom"):
        with netns.Link("10mbit") as link:
            assert link.exists()
            raise RuntimeError("boom")
    assert not link.exists()


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_torn_down_on_ctrl_c_and_sigterm(sig, tmp_path):
    # Python keeps SIGINT ignored when its parent ignored it (a background job of a non-interactive shell):
    # restore the terminal's behaviour, Ctrl-C as KeyboardInterrupt, so the test does not depend on how CI runs it.
    # The process is forked from the server that imported torch once (its own process, signalled for real).
    code = ("import signal, time; from phalanx.launch.netns import Link\n"
            "signal.signal(signal.SIGINT, signal.default_int_handler)\n"
            "with Link('10mbit') as link:\n    print(link.namespaces[0], flush=True); signal.pause()\n")
    log = tmp_path / "link.log"
    proc = start_worker("forkserver", ["-c", code], dict(os.environ), log=str(log))
    try:
        until(lambda: log.exists() and log.read_text().endswith("\n"), timeout=60, what="the link's namespace",
              procs=[proc],
              detail=lambda: log.read_text() if log.exists() else "")
        name = log.read_text().splitlines()[0].strip()
        assert name.startswith(netns.PREFIX)
        os.kill(proc.pid, sig)
        assert proc.wait(timeout=20) != 0
    finally:
        reap(proc)
    assert name not in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout


def test_namespaces_left_by_a_killed_run_are_removed_by_the_next():
    dead = subprocess.Popen(["true"])
    dead.wait()
    name = f"{netns.PREFIX}{dead.pid}a"
    subprocess.run(["ip", "netns", "add", name], check=True)
    try:
        assert name in netns.cleanup_stale()
        assert name not in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    finally:
        subprocess.run(["ip", "netns", "del", name], capture_output=True)
    assert f"{netns.PREFIX}{os.getpid()}a" not in netns.cleanup_stale()  # a live run's namespaces stay


@pytest.mark.multiproc
def test_two_workers_train_across_the_link():
    run = Run("digits_cnn", Setup("allreduce"), workers=2, link="100mbit", batch=16)
    with netns.Link("100mbit") as link:
        results = launch(run, config_for(run, Options(warmup=2, steps=4)), link=link, timeout=120)
    grad = results[0]["grad_bytes"]
    for r in results:
        # a 2-worker ring all-reduce sends each worker's whole gradient once: it crossed the veth
        assert 0.9 * grad < r["wire_bytes_per_step"] < 1.6 * grad, (r["wire_bytes_per_step"], grad)
        assert len(r["step_s"]) == 6

