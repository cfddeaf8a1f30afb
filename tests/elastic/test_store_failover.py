"""The job's store is not a single point of failure: its host is lost, a standby store takes over (issue 39 item 1).

Host A (a network namespace) runs ``phalanx run -n 2 --elastic``, whose launcher hosts the job's
store; host B adds 2 workers with ``phalanx join --standby-store``, whose launcher hosts the
standby store. Mid-epoch, A's launcher and every process in A's namespace are killed with
SIGKILL: B's workers fail over to the standby, regroup there and train on; every sample is
trained exactly once per epoch and the final model equals one process replaying the same
global batches (the world sizes at the steps the workers' ``state.history`` names). Then host A
comes back with ``phalanx join --rdzv-endpoint`` the standby, and is admitted. Needs root,
`ip` and `tc`; without them it skips and says why.

On one host (no root needed): only the launcher of ``phalanx run --replace`` is killed. Its workers end, as
a worker whose own launcher is gone must (they do not fail over), while the two joiners of the
standby's host fail over; then one of them is killed, and the standby's launcher, which took over
the job's ``--replace``, starts a replacement that the survivor admits; the two finish the training.
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
from support.forked_launch import start_cli
from support.paths import TESTS
from support.wait import until

from phalanx.launch import netns
from workers import elastic as worker

pytestmark = [pytest.mark.multiproc]

WORKER = os.path.join(TESTS, "workers", "elastic.py")
CLI = [sys.executable, "-c", "import sys; from phalanx.cli import main; sys.exit(main())"]
PORT, STANDBY_PORT = 29571, 29572  # inside namespaces A and B, where nothing else listens
EPOCHS = 4
HEARTBEAT_S = 10
HOLD_AT = 11  # the joiners enter at the commit of step 6: steps 7 to 10 are the grown group's (7 to 9 committed at 9)


def start(link: netns.Link, side: int, args: list[str], out, name: str) -> subprocess.Popen:
    """Run ``phalanx ARGS`` in namespace ``side``; its stderr goes to OUT/<name>.err."""
    iface = link.interfaces[side]
    env = {**os.environ, "GLOO_SOCKET_IFNAME": iface, "PHALANX_TIMEOUT": "60", "PHALANX_SECRET": "5f1" * 16}
    # The first workers wait for a joiner (events, not time), all 4 hold before step 11 until the test killed host A
    # (--hold-at), and the survivors, after the loss, wait for host A's return
    flags = [WORKER, "--out", str(out), "--epochs", str(EPOCHS), "--commit-every", "3", "--hold-at", str(HOLD_AT),
             "--mark-world", "--wait-for-joiner", "--joiners", "2", "--wait-for-replacement", "3"]
    with open(out / f"{name}.err", "w") as err:
        proc = subprocess.Popen(link.prefix(side) + [*CLI, *args, *flags], env=env, stdout=subprocess.DEVNULL,
                                stderr=err)
    proc.err_path = out / f"{name}.err"
    return proc


def text(proc) -> str:
    """The end of ``proc``'s stderr file ("" until a forked launcher has opened it)."""
    return proc.err_path.read_text()[-3000:] if proc.err_path.exists() else ""


def finish(proc: subprocess.Popen, timeout: float = 120) -> int:
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait()


def namespace_pids(ns: str) -> list[int]:
    return [int(p) for p in subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True,
                                           check=True).stdout.split()]


def started(out) -> dict[str, int]:
    """Worker id -> pid, from the workers' start files."""
    return {(i := json.load(open(p)))["id"]: i["pid"] for p in glob.glob(str(out / "start*.json"))}


@pytest.mark.netns
@needs_root_netns()
def test_losing_the_store_host_is_a_regroup_on_the_standby_and_the_host_comes_back(tmp_path):
    with netns.Link("1gbit") as link:
        a = start(link, 0, ["run", "-n", "2", "--elastic", "--min-workers", "1", "--max-workers", "4",
                            "--heartbeat-timeout", str(HEARTBEAT_S), "--master-addr", link.addresses[0],
                            "--master-port", str(PORT)], tmp_path, "hostA")
        until(lambda: "its store is at" in text(a), timeout=60, what="host A's store", procs=[a],
              detail=lambda: text(a))
        b = start(link, 1, ["join", "--rdzv-endpoint", f"{link.addresses[0]}:{PORT}", "-n", "2",
                            "--standby-store", f"{link.addresses[1]}:{STANDBY_PORT}"], tmp_path, "hostB")
        # all four trained 4 steps together (those steps are in a commit every survivor holds) and hold there
        until(lambda: len(held(tmp_path)) == 4, timeout=90, what="the 4 workers training together, held at step 11",
              procs=[a, b], detail=lambda: text(a) + text(b))
        assert sum(os.path.getsize(p) >= 4 for p in glob.glob(str(tmp_path / "world*-4"))) == 4
        host_b = {w for w in started(tmp_path) if w.startswith("j")}
        assert len(host_b) == 2
        killed_at = time.time()
        for pid in namespace_pids(link.namespaces[0]):  # the launcher, its store, its workers: the whole host
            os.kill(pid, signal.SIGKILL)
        finish(a)
        release(tmp_path)  # B's workers go on, to find the loss
        # B's workers regrouped on the standby (they now wait for a third worker before stepping on)
        until(lambda: "took over" in text(b) or "takes over" in text(b), timeout=60, what="the standby's take-over",
              procs=[b], detail=lambda: text(b))
        back = start(link, 0, ["join", "--rdzv-endpoint", f"{link.addresses[1]}:{STANDBY_PORT}", "-n", "1"],
                     tmp_path, "hostA-back")
        code_back, code_b = finish(back), finish(b)
    assert code_b == 0, text(b)
    assert code_back == 0, text(back)
    assert "the standby store at" in text(b) and "takes over" in text(b), text(b)
    results = {json.load(open(p))["id"]: json.load(open(p)) for p in glob.glob(str(tmp_path / "worker*.json"))}
    returned = set(results) - host_b
    assert host_b <= set(results) and len(returned) == 1 and next(iter(returned)).startswith("j"), set(results)
    record = results[min(host_b)]["record"]
    assert all(r["record"] == record for r in results.values())
    worlds = [w for _, w, _ in record]
    assert 4 in worlds and worlds[-1] == 3 and 2 in worlds[worlds.index(4):], worlds
    for epoch in range(EPOCHS):  # every sample exactly once per epoch, across the join, the lost host, the return
        ids = [i for e, _, step in record for i in step if e == epoch]
        assert ids == torch.randperm(worker.N, generator=torch.Generator().manual_seed(epoch)).tolist()
    # the world sizes the oracle replays are those the survivors' state.history names, at the steps it names
    history = results[min(host_b)]["history"]
    from_history = [next((h["world_size"] for h in reversed(history) if h["step"] <= i), 2) for i in range(len(record))]
    assert from_history == worlds, (from_history, worlds)
    want = oracle(record)
    for r in results.values():
        for got, w in zip(r["params"], want, strict=True):
            torch.testing.assert_close(torch.tensor(got), w, rtol=1e-5, atol=1e-6)
    failover = next(h for h in history if h["world_size"] == 2)
    first_step = next(t for t, world, _ in results[min(host_b)]["changes"] if world == 2)
    print(f"store host lost -> first step on the standby: {first_step - killed_at:.2f} s "
          f"(the regroup itself {failover['seconds']:.2f} s)")


def check_once_and_oracle(record: list, results: dict, epochs: int) -> None:
    """Every sample exactly once per epoch, and every survivor's model equal to the one-process replay."""
    for epoch in range(epochs):
        ids = [i for e, _, step in record for i in step if e == epoch]
        assert ids == torch.randperm(worker.N, generator=torch.Generator().manual_seed(epoch)).tolist()
    want = oracle(record)
    for r in results.values():
        for got, w in zip(r["params"], want, strict=True):
            torch.testing.assert_close(torch.tensor(got), w, rtol=1e-5, atol=1e-6)


def test_workers_whose_own_launcher_is_gone_end_and_the_others_fail_over_and_are_replaced(tmp_path):
    env = {**os.environ, "PHALANX_TIMEOUT": "60", "PHALANX_SECRET": "7a2" * 16}
    # the first workers wait for the 2 joiners (they enter at the commit of step 6); all 4 hold before step 11 until
    # the test killed the launcher (--hold-at). On the standby (the failover is the group's 2nd change), joiner j*-1
    # dies before step 14 (--kill-after), and the survivor waits for its replacement (--wait-for-replacement)
    flags = [WORKER, "--out", str(tmp_path), "--epochs", "3", "--commit-every", "3", "--hold-at", str(HOLD_AT),
             "--mark-world", "--wait-for-joiner", "--joiners", "2", "--kill-after", "j*-1@14@2",
             "--wait-for-replacement", "2"]
    err_a = open(tmp_path / "a.err", "w")
    a = subprocess.Popen([*CLI, "run", "-n", "2", "--elastic", "--replace", "--min-workers", "1", "--max-workers",
                          "4", "--heartbeat-timeout", str(HEARTBEAT_S), *flags], env=env,
                         stdout=subprocess.DEVNULL, stderr=err_a)
    a.err_path = tmp_path / "a.err"
    until(lambda: "its store is at" in text(a), timeout=60, what="the job's store", procs=[a], detail=lambda: text(a))
    endpoint = re.search(r"its store is at (\S+?);", text(a)).group(1)  # a free port of loopback
    # the joiner's launcher is forked (support.forked_launch), its worker from the one preloaded server: it is neither
    # killed nor read for what a fresh interpreter prints; its stderr (its worker's too) is b/launcher.err
    (tmp_path / "b").mkdir()
    b = start_cli(["join", "--rdzv-endpoint", endpoint, "-n", "2", "--standby-store", "127.0.0.1:0", *flags],
                  str(tmp_path / "b"), env={"PHALANX_TIMEOUT": "60", "PHALANX_SECRET": "7a2" * 16})
    b.err_path = tmp_path / "b" / "launcher.err"
    # 4 steps of the 4 together, held there: 3 are in a commit the joiners hold (commits every 3), never rolled back
    until(lambda: len(held(tmp_path)) == 4, timeout=90, what="the 4 workers training together, held at step 11",
          procs=[a, b], detail=lambda: text(a) + text(b))
    assert any(os.path.getsize(p) >= 4 for p in glob.glob(str(tmp_path / "worldj*-4")))
    first = {w: pid for w, pid in started(tmp_path).items() if not w.startswith("j")}
    a.kill()  # the launcher alone: its store goes with it, its workers are left running
    assert finish(a, 30) == -signal.SIGKILL
    release(tmp_path)  # the joiner goes on, to find the store gone
    code_b = finish(b)
    err_a.close()
    assert code_b == 0, text(b)
    for wid, pid in first.items():  # ended by their launcher's end, saying so; never failed over
        until(lambda pid=pid: not os.path.exists(f"/proc/{pid}") or open(f"/proc/{pid}/stat").read().split()[2] == "Z",
              timeout=30, what=f"worker {wid}'s end")
        assert f"its launcher (pid {a.pid}) is gone" in text(a), text(a)
    assert "took over" not in text(a) and "takes over" in text(b), text(a) + text(b)
    # the standby's launcher replaced the joiner killed after its take-over (the job was started with --replace)
    assert re.search(r"started worker r\w+-1 \(pid \d+\) to replace it", text(b)), text(b)
    results = {json.load(open(p))["id"]: json.load(open(p)) for p in glob.glob(str(tmp_path / "worker*.json"))}
    assert sorted(w[0] for w in results) == ["j", "r"], set(results)  # the surviving joiner and the replacement
    record = results[min(results)]["record"]
    assert all(r["record"] == record for r in results.values())
    worlds = [w for _, w, _ in record]
    assert 4 in worlds and worlds[-1] == 2 and 1 in worlds[worlds.index(4):], worlds  # lost, then replaced
    check_once_and_oracle(record, results, epochs=3)


def test_a_host_that_comes_back_with_a_standby_store_is_the_next_standby_and_the_workers_fail_over_twice(tmp_path):
    """Launchers A (``phalanx run``), B (``join --standby-store``), D (``join``, no store): A is lost, B takes over
    and D's worker fails over to it; C comes back with ``join --rdzv-endpoint B --standby-store``; then B is lost
    too: C takes over, and D's worker, which read the job's new standby on B's store, fails over a second time."""
    secret_env = {"PHALANX_TIMEOUT": "60", "PHALANX_SECRET": "3c9" * 16}
    # A's 2 workers wait for the 2 joiners (B's, D's); the 4 hold before step 11 (--hold-at) until A is killed;
    # on B's store the survivors wait for C's worker (--wait-for-replacement 3), and once it is in (generation 3) the
    # 3 hold again (--hold-again) until B is killed
    flags = [WORKER, "--out", str(tmp_path), "--epochs", "4", "--commit-every", "3", "--hold-at", str(HOLD_AT),
             "--mark-world", "--wait-for-joiner", "--joiners", "2", "--wait-for-replacement", "3", "--hold-again", "3"]
    err_a = open(tmp_path / "a.err", "w")
    a = subprocess.Popen([*CLI, "run", "-n", "2", "--elastic", "--min-workers", "1", "--max-workers", "4",
                          "--heartbeat-timeout", str(HEARTBEAT_S), *flags], env={**os.environ, **secret_env},
                         stdout=subprocess.DEVNULL, stderr=err_a)
    a.err_path = tmp_path / "a.err"
    until(lambda: "its store is at" in text(a), timeout=60, what="the job's store", procs=[a], detail=lambda: text(a))
    endpoint = re.search(r"its store is at (\S+?);", text(a)).group(1)

    def join(name: str, at: str, *extra: str):
        (tmp_path / name).mkdir()
        proc = start_cli(["join", "--rdzv-endpoint", at, "-n", "1", *extra, *flags], str(tmp_path / name),
                         env=secret_env)
        proc.err_path = tmp_path / name / "launcher.err"
        return proc
    b = join("b", endpoint, "--standby-store", "127.0.0.1:0")
    until(lambda: "standby store is at" in text(b), timeout=60, what="B's standby store", procs=[a, b],
          detail=lambda: text(b))
    standby_b = re.search(r"standby store is at (\S+?);", text(b)).group(1)
    d = join("d", endpoint)  # after B published its store: D's worker reads it at start
    until(lambda: len(held(tmp_path)) == 4, timeout=90, what="the 4 workers training together, held at step 11",
          procs=[a, b, d], detail=lambda: text(a) + text(b) + text(d))
    a.kill()  # A's launcher: its store goes with it; its workers end (their launcher is gone)
    assert finish(a, 30) == -signal.SIGKILL
    err_a.close()
    release(tmp_path)
    until(lambda: "takes over" in text(b), timeout=60, what="B's take-over", procs=[b, d], detail=lambda: text(b))
    c = join("c", standby_b, "--standby-store", "127.0.0.1:0")  # the host that comes back, as the next standby
    again = lambda: sorted(p.name[5:] for p in tmp_path.glob("again*"))  # noqa: E731
    until(lambda: len(again()) == 3, timeout=120, what="B's, C's and D's workers together, held again",
          procs=[b, c, d], detail=lambda: text(b) + text(c) + text(d))
    b.kill()  # B's launcher and its store: its worker ends; D's and C's fail over to C's store
    finish(b, 30)
    open(tmp_path / "release-again", "w").close()
    code_c, code_d = finish(c), finish(d)
    assert code_c == 0 and "takes over" in text(c), text(c)
    assert code_d == 0, text(d)
    assert text(d).count("took over; regrouping there") == 2, text(d)  # D's worker failed over twice
    results = {json.load(open(p))["id"]: json.load(open(p)) for p in glob.glob(str(tmp_path / "worker*.json"))}
    assert len(results) == 2, set(results)  # C's worker and D's
    record = results[min(results)]["record"]
    assert all(r["record"] == record for r in results.values())
    # D's worker went through every change: the joiners in, A lost, C's worker in, B lost (C's took no step at 3:
    # they held before it, and the loss of B rolled back to the commit that admitted it)
    assert max([h["world_size"] for h in r["history"]] for r in results.values()) == [4, 2, 3, 2], results
    worlds = [w for _, w, _ in record]
    assert [w for i, w in enumerate(worlds) if i == 0 or w != worlds[i - 1]] == [2, 4, 2], worlds
    check_once_and_oracle(record, results, epochs=4)


def test_the_standby_hosts_status_page_follows_the_job_to_the_standby(tmp_path):
    """``phalanx join --standby-store ... --status``: the page shows the job from the primary's store, then, once the
    standby took over, from the standby's (the survivors' new generation), to the job's end (issue 39, item 1)."""
    import urllib.request

    from phalanx.monitor import token
    from support.procs import free_port
    env = {**os.environ, "PHALANX_TIMEOUT": "60", "PHALANX_SECRET": "6b3" * 16}
    flags = [WORKER, "--out", str(tmp_path), "--epochs", "2", "--commit-every", "3", "--hold-at", str(HOLD_AT),
             "--wait-for-joiner", "--joiners", "2"]
    err_a = open(tmp_path / "a.err", "w")
    a = subprocess.Popen([*CLI, "run", "-n", "2", "--elastic", "--min-workers", "1", "--max-workers", "4",
                          "--heartbeat-timeout", str(HEARTBEAT_S), "--status", str(free_port()), *flags], env=env,
                         stdout=subprocess.DEVNULL, stderr=err_a)
    a.err_path = tmp_path / "a.err"
    until(lambda: "its store is at" in text(a), timeout=60, what="the job's store", procs=[a], detail=lambda: text(a))
    endpoint = re.search(r"its store is at (\S+?);", text(a)).group(1)
    page = free_port()
    (tmp_path / "b").mkdir()
    b = start_cli(["join", "--rdzv-endpoint", endpoint, "-n", "2", "--standby-store", "127.0.0.1:0", "--status",
                   f"127.0.0.1:{page}", *flags], str(tmp_path / "b"),
                  env={"PHALANX_TIMEOUT": "60", "PHALANX_SECRET": "6b3" * 16})
    b.err_path = tmp_path / "b" / "launcher.err"
    seen: dict = {}

    def status() -> dict:
        request = urllib.request.Request(f"http://127.0.0.1:{page}/status.json",
                                         headers={"Authorization": f"Bearer {token('6b3' * 16)}"})
        try:
            with urllib.request.urlopen(request, timeout=10) as r:
                seen["s"] = json.loads(r.read())
        except OSError:
            pass  # not serving yet, or gone
        return seen.get("s") or {}

    until(lambda: len(held(tmp_path)) == 4 and len(status().get("members", [])) == 4, timeout=90,
          what="B's page showing the 4 workers held at step 11", procs=[a, b], detail=lambda: f"{seen}{text(b)}")
    before = status()
    assert sorted(m[0] for m in before["members"]) == ["0", "1", "j", "j"], before
    a.kill()  # the primary's launcher and its store; its workers end with it
    assert finish(a, 30) == -signal.SIGKILL
    release(tmp_path)
    until(lambda: status().get("ended") is not None, timeout=120, what="B's page saying the job ended",
          procs=[b], detail=lambda: f"{seen}{text(b)}")
    after = seen["s"]
    assert finish(b) == 0, text(b)
    err_a.close()
    assert after["ended"]["code"] == 0, after["ended"]
    # the survivors' generation exists only in the standby's store (the primary's went with its host): the page read
    # it there. (Their step is not checked: a run that ends within a report's period may show the last one from
    # before the failover.)
    assert [m[0] for m in after["members"]] == ["j", "j"] and after["generation"] > before["generation"], after
    assert [w["worker"] for w in after["workers"]] == after["members"], after["workers"]
    assert "takes over" in text(b), text(b)
