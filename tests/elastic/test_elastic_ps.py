"""Parameter servers under ``phalanx run --elastic``: real workers, real server processes, real kills.

The synchronous PS averages each step's gradients on the servers, so a worker that dies
inside a step leaves the others waiting on a server, not in a gloo collective: they must
notice the death (its watcher marks it), abandon the round, regroup, and have the servers
key the redone steps' rounds with the new group and its worker count. The checks are
those of tests/elastic/test_elastic.py: same processes, exit 0, every sample once per epoch, and
the final model equal to one process trained on the same global batches.

Downpour and asynchronous EASGD hold the model on the servers: there the checks are that
the servers are put back to the commit rolled back to (and never by a joiner), and, for
Downpour, that the servers applied every sample exactly once (tests/workers/elastic_ps.py's
counting model). A killed server is started again and the workers roll back to their commit.
"""
from __future__ import annotations

import glob
import json
import os
import subprocess

import pytest
import torch
from support.elastic_job import check_recovered, oracle
from support.forked_launch import launch, run_cli, start_cli  # launchers forked from here, workers from one server

from phalanx.ps.reducer import Reducer
from phalanx.ps.wire import Header
from workers import elastic as worker
from workers import elastic_ps
from support.paths import TESTS
from support.wait import until


KILL = ["--kill", "1@5", "--kill-in-step", "--commit-every", "3", "--strategy", "ps-sync"]


def check_loss_then_join(history: list[dict], worlds: list[int]) -> list[tuple]:
    """Worker 1 was lost and its replacement r1 joined: in one regroup or in two, both valid.

    A replacement forked from the launcher's preloaded server (the tests' start method) is often
    ready by the regroup that follows the loss, 3 -> 3 workers (left: 1; joined: r1); a slower one
    joins at a later commit, 3 -> 2 -> 3. Returns ``(left, joined, redone_steps)`` per change.
    """
    changes = [(h["left"], h["joined"], h["redone_steps"]) for h in history]
    if len(changes) == 1:  # one regroup: the loss rolled back, the joiner took the commit rolled back to
        assert changes[0][:2] == (["1"], ["r1"]) and 2 not in worlds, (changes, worlds)
    else:  # two: the join rolled no one back
        assert [c[:2] for c in changes] == [(["1"], []), ([], ["r1"])] and changes[1][2] == 0, changes
        assert 2 in worlds, worlds
    assert worlds[:3] == [3, 3, 3] and worlds[-1] == 3, worlds
    return changes


def test_a_new_generation_redoes_a_step_with_fewer_workers_and_drops_the_old_half_filled_round():
    def grad(v):
        return [(Header("w", torch.float32, (1,)), torch.full((1,), float(v)))]
    r = Reducer(timeout=60)
    assert r.contribute(4, 3, b"a", grad(1), generation=0) is None  # worker c died before it sent step 4
    assert r.contribute(4, 3, b"b", grad(2), generation=0) is None
    assert r.contribute(4, 2, b"a", grad(3), generation=1) is None  # the survivors redo step 4, two of them
    who, means = r.contribute(4, 2, b"b", grad(5), generation=1)
    assert who == [b"a", b"b"] and means[0][1].item() == 4.0
    assert r.expire(now=float("inf")) == []  # the old generation's round was dropped, not left to time out


def test_members_a_watcher_declared_dead_do_not_count_against_the_quorum():
    import torch.distributed as dist

    from phalanx.elastic.membership import Membership, key
    store = dist.HashStore()
    for dead in ("c", "d"):  # every worker of the other host
        store.set(key("dead", dead), "1")
    store.set(key("gen", 1, "arrive", "b"), '{"commits": [3]}')
    plan = Membership(store, "a", ["a", "b", "c", "d"]).next_generation([3], timeout_s=5)
    assert plan == {"generation": 1, "members": ["a", "b"], "step": 3}

@pytest.mark.multiproc
def test_sync_ps_on_a_separate_server_survives_killing_one_of_three_workers_and_matches_the_oracle(tmp_path):
    proc, results = launch(tmp_path, "--min-workers", "2", "--servers", "1", "--", *KILL)
    seconds = check_recovered(tmp_path, proc, results, "1", 5)["kill_to_first_step_s"]
    assert seconds < 10, seconds  # the survivors left the server's round at once; its timeout is 30 s


@pytest.mark.multiproc
def test_colocated_servers_follow_the_group_through_a_kill_and_a_replacement(tmp_path):
    # the victim's server dies with it: the survivors re-place the shards over their own servers, and
    # again over the replacement's when it joins
    # the survivors wait for the replacement (its start-up can take longer than the rest of the run: it would then,
    # rightly, find the job over and leave)
    proc, results = launch(tmp_path, "--min-workers", "2", "--replace", "--", *KILL, "--epochs", "4",
                           "--wait-for-replacement", "3", timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sorted(results) == ["0", "2", "r1"]  # the replacement joined and finished with the others
    record = results["0"]["record"]
    assert all(r["record"] == record for r in results.values())
    for epoch in range(4):  # every sample exactly once per epoch, across the crash and the join
        ids = [i for e, _, step in record for i in step if e == epoch]
        assert ids == torch.randperm(worker.N, generator=torch.Generator().manual_seed(epoch)).tolist()
    check_loss_then_join(results["0"]["history"], [w for _, w, _ in record])
    want = oracle(record)  # the servers averaged over 3, (2,) then 3 workers: one process on those batches
    for r in results.values():
        for got, w in zip(r["params"], want, strict=True):
            torch.testing.assert_close(torch.tensor(got), w, rtol=1e-5, atol=1e-6)


# -- asynchronous PS (Downpour, async EASGD) on a separate server --------------------------------------------------
# tests/workers/elastic_ps.py: the same training and record as tests/workers/elastic.py, on a model under which each
# sample adds a fixed amount to the servers' parameters, whatever they are: with plain SGD on the servers, their
# final parameters count the samples applied, in any order and at any staleness (the oracle of an async run).
ASYNC = os.path.join(TESTS, "workers", "elastic_ps.py")


def launch_async(tmp_path, strategy: str, *run_flags: str, epochs: int = 2, script: tuple = (), timeout: float = 150
                 ) -> tuple[subprocess.CompletedProcess, dict, dict]:
    argv = ["run", "-n", "3", "--elastic", "--min-workers", "2", "--servers", "1", *run_flags, ASYNC,
            "--out", str(tmp_path), "--kill", "1@5", "--commit-every", "3", "--strategy", strategy,
            "--epochs", str(epochs), *script]
    proc = run_cli(argv, str(tmp_path), timeout)
    results = {json.load(open(p))["id"]: json.load(open(p)) for p in glob.glob(str(tmp_path / "worker*.json"))}
    servers = {os.path.basename(p)[7:-5]: json.load(open(p)) for p in glob.glob(str(tmp_path / "servers*.json"))}
    return proc, results, servers


def check_rolled_back_together(results: dict, servers: dict, survivors: list[str], epochs: int = 2) -> list:
    """Exit-0 checks shared by both async runs; returns the group's record."""
    record = results["0"]["record"]
    assert all(r["record"] == record for r in results.values())
    for epoch in range(epochs):  # every sample exactly once per epoch, across the crash (and the join)
        ids = [i for e, _, step in record for i in step if e == epoch]
        assert ids == torch.randperm(worker.N, generator=torch.Generator().manual_seed(epoch)).tolist()
    assert results["0"]["history"][0]["left"] == ["1"] and results["0"]["history"][0]["step"] == 3
    for wid in survivors:  # right after the regroup the server holds exactly the commit rolled back to
        [after] = servers[wid]["after_rollback"]
        assert after["step"] == 3 and after["servers"] == after["commit"], after
    # a consistent cut: every survivor's commits hold the same server snapshot (no one pushed during them)
    assert servers[survivors[0]]["commits"] == servers[survivors[1]]["commits"]
    return record


@pytest.mark.multiproc
def test_downpour_survives_a_kill_and_a_replacement_and_its_server_applies_every_sample_once(tmp_path):
    # after the loss the survivors wait for the replacement's ask, then for it to be ready (--wait-for-replacement):
    # it joins before the end however slowly it starts (the survivors wait up to 240 s: tests/workers/elastic.py)
    proc, results, servers = launch_async(tmp_path, "downpour", "--replace", epochs=4,
                                          script=("--wait-for-replacement", "3"), timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sorted(results) == ["0", "2", "r1"] and "started worker r1" in proc.stderr
    record = check_rolled_back_together(results, servers, ["0", "2"], epochs=4)
    changes = check_loss_then_join(results["0"]["history"], [w for _, w, _ in record])
    assert changes[0][2] == 1  # the loss redid step 4 (the join, if later, redid nothing)
    # the joiner's first parameters are the server's at that moment: rank 0's commit at the join step (in one
    # regroup, the commit the survivors rolled back to: rank 0 put the servers back before the joiner's pull)
    step, world, first = results["r1"]["digests"][0]
    assert world == 3 and [d for s, d in servers["0"]["commits"] if s == step][-1] == first
    assert all(c in servers["0"]["commits"] for c in servers["r1"]["commits"])
    # the oracle: the server applied each of the 4 x 64 samples exactly once (the rollback took back the
    # redone step's pushes; the join took back nothing)
    want = elastic_ps.counted(sum(len(ids) for _, _, ids in record))
    assert sum(len(ids) for _, _, ids in record) == 4 * worker.N
    for r in servers.values():
        for got, w in zip(r["final"], want, strict=True):
            torch.testing.assert_close(torch.tensor(got), w, rtol=1e-5, atol=1e-5)


@pytest.mark.multiproc
def test_async_easgd_survives_a_kill_with_its_centre_rolled_back_to_the_commit(tmp_path):
    proc, results, servers = launch_async(tmp_path, "easgd-async")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sorted(results) == ["0", "2"]
    for wid, r in results.items():  # the same processes went on
        assert [os.path.basename(s) for s in glob.glob(str(tmp_path / f"start{wid}-*.json"))] == \
            [f"start{wid}-{r['pid']}.json"]
    check_rolled_back_together(results, servers, ["0", "2"])
    assert servers["0"]["final"] == servers["2"]["final"]  # finish(): both end with the centre


@pytest.mark.multiproc
def test_a_killed_server_is_started_again_and_the_workers_roll_back_its_shards_and_train_every_sample_once(tmp_path):
    import signal
    argv = ["run", "-n", "2", "--elastic", "--min-workers", "1", "--servers", "1", ASYNC, "--out", str(tmp_path),
            "--strategy", "downpour", "--commit-every", "3", "--server-dies-at", "4"]
    launcher = start_cli(argv, str(tmp_path))  # forked from here (its server process is still its child)
    until((tmp_path / "kill-server").exists, timeout=90, what="the kill-server marker", procs=[launcher])
    [server] = [pid for pid in children(launcher.pid) if "phalanx.ps" in cmdline(pid)]
    os.kill(server, signal.SIGKILL)  # worker 0 waits after step 4, so the kill lands mid-epoch
    (tmp_path / "server-killed").touch()
    stderr = launcher.communicate(timeout=120)[1]
    assert launcher.returncode == 0, stderr[-3000:]
    [line] = [ln for ln in stderr.splitlines() if "parameter server" in ln]
    assert f"pid {server}" in line and "started it again" in line and "Traceback" not in stderr, stderr[-2000:]
    results = {json.load(open(p))["id"]: json.load(open(p)) for p in glob.glob(str(tmp_path / "worker*.json"))}
    servers = {os.path.basename(p)[7:-5]: json.load(open(p)) for p in glob.glob(str(tmp_path / "servers*.json"))}
    assert sorted(results) == ["0", "1"]
    [change] = results["0"]["history"]
    assert (change["left"], change["joined"], change["step"]) == ([], [], 3) and "parameter server" in change["cause"]
    record = results["0"]["record"]
    for epoch in (0, 1):  # every sample once per epoch, across the server's death
        ids = [i for e, _, step in record for i in step if e == epoch]
        assert ids == torch.randperm(worker.N, generator=torch.Generator().manual_seed(epoch)).tolist()
    for r in servers.values():  # the restarted server got the commit's shards back: it applied each sample once
        [after] = r["after_rollback"]
        assert after["servers"] == after["commit"], after
        for got, w in zip(r["final"], elastic_ps.counted(2 * worker.N), strict=True):
            torch.testing.assert_close(torch.tensor(got), w, rtol=1e-5, atol=1e-5)


def test_a_request_refused_by_a_restarted_server_gives_up_so_that_the_group_rolls_back():
    from phalanx.errors import WorkerLostError
    from phalanx.ps.client import Client, PSError
    from phalanx.ps.server import Server
    server = Server().start()  # empty, as a restarted one is: it knows no variable
    client = Client([server.address], timeout=10)
    try:
        pull = {0: ({"op": "pull", "names": ["w"]}, [])}
        with pytest.raises(PSError, match="refused"):
            client.call(pull)  # nothing restarted: a refusal is an error
        client.abandon = lambda: "a parameter server exited and the launcher started it again"
        with pytest.raises(WorkerLostError, match="started it again"):
            client.call(pull)  # a peer failure: the elastic group rolls back and restores the shards
    finally:
        client.close()
        server.stop(save=False)


def test_a_server_that_keeps_exiting_ends_the_job_instead_of_a_restart():
    import torch.distributed as dist

    from phalanx.ps.launcher import MAX_RESTARTS, restart_exited
    from phalanx.ps.launcher import start_servers
    store = dist.HashStore()
    with start_servers(1) as servers:
        servers.procs[0].kill()
        servers.procs[0].wait()
        servers.restarts = MAX_RESTARTS  # it was started again that many times already
        assert not restart_exited(servers, store, servers.exited())
        assert not servers.alive()[0]


def children(pid: int) -> list[int]:
    out = []
    for stat in glob.glob("/proc/[0-9]*/stat"):
        try:
            with open(stat) as f:
                if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                    out.append(int(stat.split("/")[2]))
        except (FileNotFoundError, ProcessLookupError, ValueError):
            pass
    return out


def cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except FileNotFoundError:
        return ""
