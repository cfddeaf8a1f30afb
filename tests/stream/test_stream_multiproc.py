"""Streaming on real worker processes (gloo) from a real redis-server, with real crashes and restarts.

Each worker logs the ids it trained on per step; the final model's history is rebuilt
from those logs (a restarted incarnation's steps replace the steps it re-trained) and
checked against every id the producer published: none missing, none twice.
"""
from __future__ import annotations

import collections
import os
import random
import shutil
import subprocess
import sys
import threading
from typing import Any

import pytest
import torch

from phalanx.checkpoint import read_checkpoint
from support.forked_launch import run_cli  # the launcher forked from this process, its workers from one server
from support.procs import run_workers
from support.paths import TESTS
from support.wait import until

pytestmark = pytest.mark.multiproc


@pytest.fixture(scope="module")
def server():
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed (make setup installs it as root)")
    from phalanx.stream.broker import RedisServer
    s = RedisServer()
    yield s
    s.stop()


def producer_process(url: str, stream: str, count: int, rate: float, *args: str) -> subprocess.Popen:
    """``python -m phalanx.stream.producer``: a producer that outlives the broker it publishes to."""
    return subprocess.Popen([sys.executable, "-m", "phalanx.stream.producer", url, stream, "--count", str(count),
                             "--rate", str(rate), "--end", *args])


class Feed(threading.Thread):
    """The producer's :func:`~phalanx.stream.producer.publish` (what its command line runs: real XADDs to the real
    redis-server, at the set rate, then the end marker) on a thread of the test process: the same events, without a
    fresh interpreter importing torch for each test (about 1.5 CPU s each)."""

    def __init__(self, url: str, stream: str, count: int, rate: float, **options: Any) -> None:
        super().__init__(daemon=True)  # a failed test leaves it to finish its count (seconds) on its own stream
        self.args, self.options, self.error = (url, stream), {"count": count, "rate": rate, **options}, None
        self.start()

    def run(self) -> None:
        from phalanx.stream.producer import publish
        try:
            publish(*self.args, end=True, **self.options)
        except BaseException as err:  # noqa: BLE001 - re-raised in the test's thread by wait()
            self.error = err

    def wait(self, timeout: float) -> int:
        """0 once every event and the end marker are published (as the command's exit status); raises otherwise."""
        self.join(timeout)
        assert not self.is_alive(), f"the producer did not finish within {timeout:g} s"
        if self.error is not None:
            raise self.error
        return 0

    def kill(self) -> None:
        """Nothing to end: the thread stops after its count (the test's ``finally`` for a process)."""


def producer(url: str, stream: str, count: int, rate: float, **options: Any) -> Feed:
    return Feed(url, stream, count, rate, **options)


def published(url: str, stream: str) -> list[str]:
    import redis
    return [i.decode() for i, f in redis.Redis.from_url(url).xrange(stream) if b"phalanx-end" not in f]


def steps_logged(log_dir) -> dict[tuple[int, int], list[str]]:
    """``{(incarnation, step): ids}`` over every rank's log."""
    steps: dict[tuple[int, int], list[str]] = collections.defaultdict(list)
    for name in sorted(os.listdir(log_dir)):
        inc = int(name.split(".")[0][3:])
        with open(os.path.join(log_dir, name)) as f:
            for line in f:
                step, _weight, *ids = line.split()
                steps[inc, int(step)] += ids
    return steps


def final_history(log_dir) -> list[str]:
    """The ids behind the final model: each step as the last incarnation that trained it trained it."""
    last: dict[int, tuple[int, list[str]]] = {}
    for (inc, step), ids in steps_logged(log_dir).items():
        if step not in last or inc > last[step][0]:
            last[step] = (inc, ids)
    return [i for step in sorted(last) for i in last[step][1]]


def run(server, tmp_path, stream, world_size, incarnation, *, timeout=90.0, check=True, **kwargs):
    log_dir = tmp_path / "logs"
    log_dir.mkdir(exist_ok=True)
    return run_workers("workers.stream:train", world_size=world_size, timeout=timeout, check=check,
                       url=server.url, stream=stream, group="trainer", ckpt=str(tmp_path / "ckpt.pt"),
                       log_dir=str(log_dir), incarnation=incarnation, **kwargs)


def assert_exactly_once(server, tmp_path, stream, result):
    trained = final_history(tmp_path / "logs")
    duplicates = [i for i, n in collections.Counter(trained).items() if n > 1]
    missing = set(published(server.url, stream)) - set(trained)
    assert not duplicates and not missing, f"{len(duplicates)} trained twice, {len(missing)} lost"
    assert len(trained) == len(published(server.url, stream))
    assert result["pending"] == 0  # the final commit was acknowledged and nothing else stays claimed


@pytest.mark.parametrize("trial,restart_workers", [(0, 3), (1, 2), (2, 3)])
def test_exactly_once_when_a_worker_dies_and_the_group_restarts_from_the_checkpoint(server, tmp_path, trial,
                                                                                     restart_workers):
    rng = random.Random(trial)
    stream, kill_rank, kill_step = f"fire{trial}", rng.randrange(3), rng.randrange(6, 25)
    # the events still arrive while the workers train (96 a step; the kill, at step 24 at the latest, comes before the
    # 3000th), at 3000 a second: the run waits 1 s for the producer, not 3
    feed = producer(server.url, stream, 3000, 3000)
    try:
        crashed = run(server, tmp_path, stream, 3, 0, batch_size=32, kill_step=kill_step, kill_rank=kill_rank,
                      check=False)
        assert crashed.returncodes[kill_rank] == 1 and crashed.results[0] is None  # the crash really happened
        restarted = run(server, tmp_path, stream, restart_workers, 1, batch_size=32).results[0]
        assert feed.wait(timeout=30) == 0
    finally:
        feed.kill()
    committed = (kill_step - 1) // 5 * 5  # the kill comes before step kill_step trains (and commits)
    assert restarted["resumed"] == committed
    logged = steps_logged(tmp_path / "logs")
    if kill_step - 1 > committed:  # the crashed steps after the commit were really trained, and are trained again
        assert logged[0, kill_step - 1] and logged[1, kill_step - 1]
    assert_exactly_once(server, tmp_path, stream, restarted)


def test_exactly_once_after_every_worker_dies_and_everything_restarts(server, tmp_path):
    stream = "full"
    feed = producer(server.url, stream, 600, 0)
    feed.wait(timeout=30)
    crashed = run(server, tmp_path, stream, 2, 0, batch_size=16, kill_step=7, kill_rank=-1, check=False)
    assert crashed.returncodes == [1, 1]
    restarted = run(server, tmp_path, stream, 2, 1, batch_size=16).results[0]
    assert restarted["resumed"] == 5 and restarted["steps"] == 600 // 32 + 1
    assert_exactly_once(server, tmp_path, stream, restarted)


def test_odd_and_undecodable_events_are_dropped_by_every_worker_and_dead_lettered_once_across_a_crash(server,
                                                                                                     tmp_path):
    import redis

    from phalanx.stream.producer import publish
    stream = "poison"
    publish(server.url, stream, count=300, bad_every=13, odd_every=7, end=True)  # shapes (3,) among (8,)
    entries = redis.Redis.from_url(server.url).xrange(stream)
    good = [i.decode() for i, f in entries if f.get(b"shape") == b"8"]
    bad = sorted(i.decode() for i, f in entries if f.get(b"shape") != b"8" and b"phalanx-end" not in f)
    crashed = run(server, tmp_path, stream, 2, 0, batch_size=8, kill_step=12, kill_rank=1, check=False)
    assert crashed.returncodes[1] == 1
    restarted = run(server, tmp_path, stream, 2, 1, batch_size=8).results[0]
    assert restarted["resumed"] == 10 and restarted["dead"] == len(bad) == 62
    trained = final_history(tmp_path / "logs")
    assert sorted(trained) == sorted(good) and len(trained) == len(set(trained))  # rank 1 dropped the same ones
    dead = redis.Redis.from_url(server.url).xrange(f"{stream}:dead")
    assert sorted(f[b"phalanx-id"].decode() for _, f in dead) == bad  # each once, though steps 11-12 ran twice


def test_two_workers_equal_one_process_on_the_same_global_batches(server, tmp_path):
    from phalanx.stream.producer import publish
    from workers.stream import train
    publish(server.url, "oracle", count=2 * 8 * 6, end=True)
    logs = tmp_path / "one"
    logs.mkdir()
    one = train(server.url, "oracle", "one", batch_size=16, ckpt=str(tmp_path / "one.pt"), log_dir=str(logs))
    two = run_workers("workers.stream:train", world_size=2, url=server.url, stream="oracle", group="two",
                      batch_size=8, ckpt=str(tmp_path / "two.pt"), log_dir=str(tmp_path)).results
    assert one["steps"] == two[0]["steps"] == 6
    for r in two:
        assert ((r["params"] - one["params"]).norm() / one["params"].norm()).item() < 1e-5


def test_a_producer_pause_neither_hangs_nor_takes_an_empty_step(server, tmp_path):
    stream = "pause"
    # the pause is 3 times the workers' deadline (0.3 s): several deadlines pass with nothing to train
    feed = producer(server.url, stream, 400, 400, pause_at=200, pause_s=1.0)
    try:
        result = run(server, tmp_path, stream, 2, 0, batch_size=16, deadline_s=0.3).results[0]
        assert feed.wait(timeout=30) == 0
    finally:
        feed.kill()
    for (_, step), ids in steps_logged(tmp_path / "logs").items():
        assert len(ids) >= 2, f"step {step} trained {len(ids)} events"  # one event per worker at least
    assert_exactly_once(server, tmp_path, stream, result)


def test_redis_stopped_mid_run_is_a_clear_error_in_bounded_time_and_the_last_commit_stays(tmp_path):
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed")
    from phalanx.stream.broker import RedisServer
    server = RedisServer()
    feed = producer_process(server.url, "doomed", 100000, 300)  # a process: it must outlive the broker
    ckpt = tmp_path / "ckpt.pt"

    def kill_redis_after_a_commit():
        # Real processes: poll (bounded) for the first commit and two steps past it, then kill the broker.
        log = tmp_path / "logs" / "inc0.rank0.log"
        until(lambda: ckpt.exists() and log.exists() and log.read_text().count("\n") >= 5, timeout=60,
              what="the first commit and two steps past it")
        server.process.kill()

    killer = threading.Thread(target=kill_redis_after_a_commit)
    killer.start()
    try:
        crashed = run(server, tmp_path, "doomed", 2, 0, batch_size=8, every=3, check=False, timeout=60)
    finally:
        killer.join()
        feed.kill()
        server.stop()
    assert all(code == 1 for code in crashed.returncodes), crashed.returncodes  # not killed by the test timeout
    assert server.url in crashed.log(0) and "did not answer" in crashed.log(0)
    assert "lost the stream" in crashed.log(1)
    body = read_checkpoint(ckpt)  # intact (verified), and it is the last commit the workers made
    last_commit = max(s for (_, s) in steps_logged(tmp_path / "logs") if s % 3 == 0)
    main = body["ranks"][0]
    assert body["step"] == last_commit and main["loader"]["steps"] == last_commit
    assert isinstance(main["loader"]["position"], str) and torch.is_tensor(main["model"]["0.weight"])


def test_exactly_once_when_an_elastic_group_loses_a_worker_and_a_new_one_joins(server, tmp_path):
    """Under `phalanx run --elastic --replace` the survivors roll back in memory (the same restore as from disk),
    then a new worker joins at a commit point with rank 0's state and the stream goes on from there."""
    import glob
    import json
    stream = "elastic"
    script = os.path.join(TESTS, "workers", "stream_elastic.py")
    feed = producer(server.url, stream, 3000, 1000)
    try:
        proc = run_cli(["run", "-n", "3", "--elastic", "--min-workers", "2", "--replace", script,
                        "--url", server.url, "--stream", stream, "--out", str(tmp_path), "--kill", "1@8",
                        "--slow-after-loss", "0.5"], str(tmp_path), timeout=240)
        assert feed.wait(timeout=30) == 0
    finally:
        feed.kill()
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = {r["id"]: r for r in (json.load(open(p)) for p in glob.glob(str(tmp_path / "worker*.json")))}
    assert sorted(results) == ["0", "2", "r1"], proc.stderr[-2000:]
    summary = {k: (r["world_size"], r["history"], len(r["record"])) for k, r in results.items()}
    assert all(r["world_size"] == 3 for r in results.values()), summary  # the joiner was admitted
    for r in results.values():  # the loss may surface in a step's exchange; a membership change never does
        assert not [e for e in r["raised"] if e.startswith(("JoinersAdmitted", "WorkersLeaving"))], r["raised"]
    # The loss and the join, in one regroup or two: a replacement forked from the launcher's preloaded server is
    # often ready by the regroup after the loss (3 -> 3 workers); a slower one joins at a later commit (3 -> 2 -> 3).
    lost, *later = results["0"]["history"]
    assert lost["left"] == ["1"] and lost["step"] == 6 and lost["redone_steps"] == 1  # step 7 is redone
    if later:
        [joined] = later
        assert lost["joined"] == [] and joined["left"] == [], summary
        assert joined["joined"] == ["r1"] and joined["redone_steps"] == 0  # the join rolled no one back
    else:
        assert lost["joined"] == ["r1"], summary  # it took the commit the survivors rolled back to
    record = results["0"]["record"]
    assert record == results["2"]["record"] == results["r1"]["record"]
    trained = [i for step in record for i in step]
    assert len(trained) == len(set(trained)) and sorted(trained) == sorted(published(server.url, stream))
    assert results["0"]["pending"] == 0


def test_under_elastic_a_sigterm_leave_and_a_join_come_out_of_the_loaders_iteration_never_out_of_opt_step(
        server, tmp_path):
    """The stream loader is its own commit point (``before_batch``), as ``px.shard``'s is: worker 1, sent SIGTERM
    before step 5, leaves at the commit point of step 6, and its replacement (offered a place at the commit point
    of step 9, ready before step 12) enters at the commit point of step 12. Both changes come out of the loop's
    ``for x, y in loader`` (the loop wraps ``opt.step()`` in ``try/except BaseException``: nothing may come out of
    it), nothing is redone, every event is trained once."""
    import glob
    import json
    from phalanx.stream.producer import publish
    stream = "leave-join"
    publish(server.url, stream, count=400, end=True)  # a backlog: the members' waits cannot outlast the stream
    script = os.path.join(TESTS, "workers", "stream_elastic.py")
    proc = run_cli(["run", "-n", "2", "--elastic", "--min-workers", "1", "--replace", script,
                    "--url", server.url, "--stream", stream, "--out", str(tmp_path), "--batch-size", "8",
                    "--term", "1@5", "--admit-at", "12"], str(tmp_path), timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = {r["id"]: r for r in (json.load(open(p)) for p in glob.glob(str(tmp_path / "worker*.json")))}
    assert sorted(results) == ["0", "r1"], proc.stderr[-2000:]
    for r in results.values():
        assert r["raised"] == [], r["raised"]  # nothing came out of opt.step()
    assert [(h["left"], h["joined"], h["step"], h["redone_steps"]) for h in results["0"]["history"]] == \
        [(["1"], [], 6, 0), ([], ["r1"], 12, 0)], proc.stderr[-2000:]
    assert "worker 1 leaves the group after step 6" in proc.stderr
    record = results["0"]["record"]
    assert results["r1"]["record"] == record and all(r["world_size"] == 2 for r in results.values())
    assert [len(ids) for ids in record[:13]] == [16] * 6 + [8] * 6 + [16]  # 2 workers, 1 after the leave, 2 again
    trained = [i for step in record for i in step]
    assert len(trained) == len(set(trained)) and sorted(trained) == sorted(published(server.url, stream))
    assert results["0"]["pending"] == 0
