"""Hot spares: `phalanx run --elastic --spares K` (real workers, a real kill -9).

A spare is a joiner started with the job: it imports torch and the script, then waits
parked in the store. When a worker dies the survivors' quorum admits it at the
regroup, and rank 0 sends it the commit everyone rolls back to.
"""
from __future__ import annotations

import glob
import json
import os

import pytest
import torch

from phalanx import ConfigError
from phalanx.elastic.options import ElasticConfig
from phalanx.elastic.admission import admissible
from phalanx.launch.run import RunConfig
from support.elastic_job import oracle
from support.forked_launch import launch  # the launcher forked from this process, its workers from one server
from workers import elastic as worker
from support.wait import until


@pytest.mark.parametrize("argv, words", [
    (["-n", "3", "--spares", "1"], "--spares without --elastic"),
    (["-n", "3", "--elastic", "--spares", "-1"], "--spares -1"),
    (["-n", "3", "--elastic", "--spares", "two"], "--spares two"),
    (["-n", "3", "--elastic", "--spares", "2", "--max-workers", "4"], "-n 3 --spares 2 with --max-workers 4"),
])
def test_bad_spares_flags_get_one_clear_line(argv, words):
    with pytest.raises(ConfigError) as err:
        RunConfig.from_argv([*argv, worker.__file__])
    assert words in str(err.value) and len(str(err.value).splitlines()) == 1


def test_spares_raise_the_default_max_workers_and_fill_only_the_places_of_the_lost():
    cfg = RunConfig.from_argv(["-n", "3", "--elastic", "--spares", "2", worker.__file__]).elastic
    assert (cfg.spares, cfg.max_workers, cfg.min_workers) == (2, 5, 2)
    assert ElasticConfig.from_flags(nproc=3, min_workers=None, max_workers=None, heartbeat=None).spares == 0
    # the group at full size: spares stay parked, a joiner may still grow it up to --max-workers
    assert admissible(["0", "1", "2"], ["s0", "s1"], spares={"s0", "s1"}, workers=3, max_workers=5) == []
    # one lost: exactly one spare comes in, the first in line
    assert admissible(["0", "2"], ["s0", "s1"], spares={"s0", "s1"}, workers=3, max_workers=5) == ["s0"]
    assert admissible(["0"], ["s1"], spares={"s0", "s1"}, workers=3, max_workers=5) == ["s1"]
    assert admissible(["0", "2"], ["j", "s0"], spares={"s0"}, workers=3, max_workers=3) == ["j"]


@pytest.mark.multiproc
def test_a_spare_takes_the_lost_workers_place_with_rank_0s_exact_state(tmp_path):
    # 3 workers and 2 spares; the worker started as rank 1 dies at step 5 (commits every 3),
    # once both spares are parked. s0 takes its place at the regroup; s1 is never needed.
    proc, results = launch(tmp_path, "--min-workers", "2", "--spares", "2", "--",
                           "--kill", "1@5", "--commit-every", "3")
    assert proc.returncode == 0, proc.stderr[-3000:]
    killed = json.load(open(tmp_path / "killed.json"))
    assert sorted(results) == ["0", "2", "s0"] and "spare s0" in proc.stderr
    assert "started worker" not in proc.stderr  # no new process was started
    for wid, r in results.items():  # one process each, started before the kill
        [start] = glob.glob(str(tmp_path / f"start{wid}-*.json"))
        assert start.endswith(f"-{r['pid']}.json") and os.path.getmtime(start) < killed["time"]
    spare, main = results["s0"], results["0"]
    # the unused spare waited in px.init() until training ended, then left (exit 0) without training
    assert "worker s1: training ended before it was admitted" in proc.stderr
    assert glob.glob(str(tmp_path / "starts1-*.json")) and not os.path.exists(tmp_path / "inits1.json")
    # what each script read right after px.init(): the spare its admitted place (rank 2 of 3, generation 1), as
    # RANK and WORLD_SIZE tell a torchrun worker its place; the members their own
    inits = [json.load(open(tmp_path / f"init{w}.json")) for w in ("0", "2", "s0")]
    assert [(i["rank"], i["world_size"], i["generation"], i["env"]) for i in inits] == [
        (0, 3, 0, ["0", "3"]), (2, 3, 0, ["2", "3"]), (2, 3, 1, ["2", "3"])]
    # the group is back to 3 at the regroup: rolled back to commit 3, step 4 redone by 3 workers
    [change] = main["history"]
    assert (change["left"], change["joined"], change["world_size"], change["step"]) == (["1"], ["s0"], 3, 3)
    assert change["redone_steps"] == 1 and spare["history"][0]["joined"] == ["s0"]
    assert all(r["world_size"] == 3 for r in (main, spare, results["2"]))
    # the spare's first step: bit-identical weights and momentum to rank 0's at that step
    first_step, world, state = spare["digests"][0]
    assert first_step == 3 and world == 3
    assert [d[2] for d in main["digests"] if d[0] == first_step][-1] == state
    record = main["record"]
    assert spare["record"] == record and results["2"]["record"] == record and spare["params"] == main["params"]
    assert [w for _, w, _ in record] == [3] * len(record)
    for epoch in (0, 1):  # every sample exactly once per epoch
        ids = [i for e, _, step in record for i in step if e == epoch]
        assert ids == torch.randperm(worker.N, generator=torch.Generator().manual_seed(epoch)).tolist()
    for got, want in zip(main["params"], oracle(record), strict=True):  # the uninterrupted run on those batches
        torch.testing.assert_close(torch.tensor(got), want, rtol=1e-5, atol=1e-6)


@pytest.mark.multiproc
def test_one_survivor_of_two_goes_on_with_the_spare(tmp_path):
    # The dead worker was seen dying by the launcher, so the split-brain guard leaves it out: the lone
    # survivor is the whole live group, and the parked spare joins it at the regroup (2 -> 2 workers).
    proc, _ = launch(tmp_path, "--min-workers", "1", "--spares", "1", "--", "--kill", "1@3", "--commit-every", "2",
                     n=2, timeout=90)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "joined: s0" in proc.stderr and "2 -> 2 workers" in proc.stderr


def test_the_launcher_uses_spares_first_then_replace_and_drops_a_dead_parked_spare():
    # The launcher's bookkeeping with real processes (sleepers stand in for workers) and a real store.
    import signal
    import subprocess
    import threading

    import torch.distributed as dist

    from phalanx.launch.elastic import _stop_all, _watch, _Worker
    from phalanx.elastic.membership import key

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    store.set(key("gen", 0, "members"), json.dumps(["0", "1", "2", "3"]))
    sleeper = lambda wid: _Worker(wid, subprocess.Popen(["sleep", "60"]))  # noqa: E731
    workers = [sleeper(w) for w in ("0", "1", "2", "3", "s0", "s1")]
    started, reserve, stop = [], ["s0", "s1"], {"sig": None}

    def joiner(wid: str) -> _Worker:
        started.append(wid)
        return sleeper(wid)

    el = ElasticConfig(min_workers=2, max_workers=6, replace=True, spares=2)
    watch = threading.Thread(target=lambda: started.append(_watch(workers, store, el, stop, joiner, reserve)))
    watch.start()
    try:
        def kill_and_wait(wid: str) -> None:
            w = next(w for w in workers if w.id == wid)
            w.proc.kill()
            until(lambda: w.returncode is not None, timeout=10, what=f"worker {wid}'s exit")
            assert w.returncode == -signal.SIGKILL and store.check([key("dead", wid)])

        # The watcher writes the dead mark, then hands out a spare or starts a replacement: wait for that second
        # act (bounded), rather than assert it the moment the mark is there.
        kill_and_wait("s1")  # a parked spare dies: one spare fewer, nothing started
        until(lambda: reserve == ["s0"], timeout=10, what="the dead spare dropped")
        assert started == []
        kill_and_wait("1")  # a member dies: the spare left takes its place, nothing started
        until(lambda: reserve == [], timeout=10, what="the spare handed out")
        assert started == []
        kill_and_wait("2")  # no spare left: --replace starts a process
        until(lambda: started == ["r1"], timeout=10, what="a replacement started")
    finally:
        stop["sig"] = signal.SIGTERM
        watch.join(10)
        _stop_all(workers)
    assert started == ["r1", 128 + signal.SIGTERM]
