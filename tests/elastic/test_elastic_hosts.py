"""Elastic training across two hosts: two network namespaces joined by a veth pair.

Host A runs ``phalanx run -n 2 --elastic`` (its launcher hosts the store on A's veth
address); host B adds 2 workers with ``phalanx join``. Then every worker of one host
is killed with SIGKILL, and the other host's workers must go on: exit 0, every sample
exactly once per epoch, and the final model equal to one process trained on the same
global batches. These need root, `ip` and `tc`; without them they skip and say why.
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
import torch
from conftest import needs_root_netns
from support.elastic_job import held, oracle, release

from phalanx.launch import netns
from workers import elastic as worker
from support.paths import TESTS
from support.wait import until

pytestmark = [pytest.mark.netns, pytest.mark.multiproc, needs_root_netns()]

WORKER = os.path.join(TESTS, "workers", "elastic.py")
CLI = [sys.executable, "-c", "import sys; from phalanx.cli import main; sys.exit(main())"]
PORT = 29561  # inside namespace A, where nothing else listens
EPOCHS = 6
HEARTBEAT_S = 30  # long: a recovery much faster than this was found by a watcher, not by a stale heartbeat
HOLD_AT = 11  # joined at the commit of step 6: steps 7 to 10 are the 4 workers' (7 to 9 in the commit of step 9)


def start(link: netns.Link, side: int, args: list[str], out) -> subprocess.Popen:
    """Run ``phalanx ARGS`` in namespace ``side``; its stderr goes to OUT/host<side>.err."""
    iface = link.interfaces[side]
    # both hosts hold the job's secret: the launcher takes it from PHALANX_SECRET, `phalanx join` presents it
    env = {**os.environ, "GLOO_SOCKET_IFNAME": iface, "PHALANX_TIMEOUT": "60", "PHALANX_SECRET": "6e7" * 16}
    # host A's 2 workers wait for B's to ask, then to be ready (they enter at the commit of step 6: events, not
    # time); all 4 hold before step 11 (--hold-at) until the test has killed a host
    flags = [WORKER, "--out", str(out), "--epochs", str(EPOCHS), "--commit-every", "3", "--mark-world",
             "--wait-for-joiner", "--joiners", "2", "--hold-at", str(HOLD_AT)]
    with open(out / f"host{side}.err", "w") as err:
        proc = subprocess.Popen(link.prefix(side) + [*CLI, *args, *flags], env=env, stdout=subprocess.DEVNULL,
                                stderr=err)
    proc.err_path = out / f"host{side}.err"
    return proc


def two_hosts(link: netns.Link, out) -> tuple[subprocess.Popen, subprocess.Popen]:
    """A: the launcher and 2 workers; B: `phalanx join -n 2`. Returns once all 4 took 4 steps together and hold
    there (before step 11, until :func:`release`).

    Four steps with commits every 3: the 4-worker steps are in a commit, so the kill
    rolls back to a commit that has them and the oracle sees every world size.
    """
    a = start(link, 0, ["run", "-n", "2", "--elastic", "--min-workers", "2", "--max-workers", "4",
                        "--heartbeat-timeout", str(HEARTBEAT_S), "--master-addr", link.addresses[0],
                        "--master-port", str(PORT)], out)
    # `phalanx join` refuses an endpoint with no job: wait for the store
    until(lambda: "its store is at" in a.err_path.read_text(), timeout=60, what="host A's store", procs=[a],
          detail=lambda: a.err_path.read_text()[-2000:])
    b = start(link, 1, ["join", "--rdzv-endpoint", f"{link.addresses[0]}:{PORT}", "-n", "2"], out)
    until(lambda: len(held(out)) == 4, timeout=90, what="the 4 workers training together, held at step 11",
          procs=[a, b], detail=lambda: f"{a.err_path.read_text()[-2000:]} {b.err_path.read_text()[-2000:]}")
    assert sum(os.path.getsize(p) >= 4 for p in glob.glob(str(out / "world*-4"))) == 4
    return a, b


def finish(proc: subprocess.Popen, timeout: float = 120) -> tuple[int, str]:
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    return proc.returncode, proc.err_path.read_text()


def pids(out, prefix: str) -> dict[str, int]:
    """Worker id -> pid, from the start files of the workers whose id starts with ``prefix``."""
    found = {}
    for path in glob.glob(str(out / "start*.json")):
        info = json.load(open(path))
        if re.match(prefix, info["id"]):
            found[info["id"]] = info["pid"]
    return found


def check_survivors(out, survivors: set[str], killed_at: float) -> None:
    results = {json.load(open(p))["id"]: json.load(open(p)) for p in glob.glob(str(out / "worker*.json"))}
    assert set(results) == survivors
    record = results[min(survivors)]["record"]
    assert all(r["record"] == record for r in results.values())
    worlds = [w for _, w, _ in record]
    assert 4 in worlds and worlds[-1] == 2, worlds
    for epoch in range(EPOCHS):  # every sample exactly once per epoch, across the join and the lost host
        ids = [i for e, _, step in record for i in step if e == epoch]
        assert ids == torch.randperm(worker.N, generator=torch.Generator().manual_seed(epoch)).tolist()
    want = oracle(record)  # one process on the same global batches (8, 16, then 8 samples per step)
    for r in results.values():
        for got, w in zip(r["params"], want, strict=True):
            torch.testing.assert_close(torch.tensor(got), w, rtol=1e-5, atol=1e-6)
        assert [h["world_size"] for h in r["history"]][-1] == 2
    # found by a watcher at once, not after the heartbeat timeout (+10 s quorum wait) of a silent host
    regrouped = [h["time"] for h in results[min(survivors)]["history"] if h["left"]]
    assert len(regrouped) == 1 and regrouped[0] - killed_at < HEARTBEAT_S / 2, (regrouped, killed_at)


def test_killing_every_worker_of_the_joined_host_leaves_the_launcher_host_training(tmp_path):
    with netns.Link("1gbit") as link:
        a, b = two_hosts(link, tmp_path)
        victims = pids(tmp_path, "j")
        assert len(victims) == 2
        killed_at = time.time()
        for pid in victims.values():
            os.kill(pid, signal.SIGKILL)
        release(tmp_path)  # the survivors go on, to find the loss
        code_a, err_a = finish(a)
        code_b, err_b = finish(b)
    assert code_a == 0, err_a[-3000:]
    assert code_b != 0  # its workers were killed; its watcher said so
    for wid in victims:
        assert f"worker {wid} " in err_b and "was killed by SIGKILL" in err_b, err_b[-2000:]
    check_survivors(tmp_path, {"0", "1"}, killed_at)


def test_killing_every_worker_of_the_launcher_host_leaves_the_joined_host_training(tmp_path):
    with netns.Link("1gbit") as link:
        a, b = two_hosts(link, tmp_path)
        victims = pids(tmp_path, r"\d")
        assert sorted(victims) == ["0", "1"]
        killed_at = time.time()
        for pid in victims.values():
            os.kill(pid, signal.SIGKILL)
        release(tmp_path)  # the survivors go on, to find the loss
        code_b, err_b = finish(b)
        code_a, err_a = finish(a)  # the launcher keeps the store up until the joined workers finish
    assert code_b == 0, err_b[-3000:]
    assert code_a == 0, err_a[-3000:]
    check_survivors(tmp_path, set(pids(tmp_path, "j")), killed_at)
