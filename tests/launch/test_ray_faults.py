"""phalanx on Ray under the faults Ray Train mishandles: a replacement arriving after the end, two losses at once.

A Ray cluster of 3 nodes on this machine (``ray.cluster_utils.Cluster``, shared by the
module), real kills (SIGKILL of the worker actors' processes, placed by marker files the
job writes). The training function is tests/workers/ray_train.py; the oracle retrains one
process on the global batches the group recorded, as tests/test_ray.py does.
"""
from __future__ import annotations

import glob
import json
import os
import signal
import threading

import pytest
import torch

ray = pytest.importorskip("ray", reason="ray is not installed (pip install 'phalanx[ray]')")
pytest.importorskip("ray.train", reason="ray[train] is not installed (pip install 'phalanx[ray]')")

from phalanx.launch.raytrain import train  # noqa: E402
from support import ray_cluster  # noqa: E402
from support.wait import until  # noqa: E402
from workers import elastic as loop  # noqa: E402
from workers import ray_train as worker  # noqa: E402

cluster = ray_cluster.cluster  # the module's Ray cluster (a fixture)


def results(out) -> dict:
    return {json.load(open(p))["id"]: json.load(open(p)) for p in glob.glob(str(out / "worker*.json"))}


def kill_when_parked(out, names: list[str], timeout_s: float = 600.0) -> list[dict]:
    """Wait until every victim has written its pid where it parks, then SIGKILL their processes back to back."""
    until(lambda: all((out / n).exists() for n in names), timeout=timeout_s, what="the victims' pid files")
    victims = [json.load(open(out / n)) for n in names]
    for v in victims:
        os.kill(v["pid"], signal.SIGKILL)
    return victims


def check_exactly_once_and_oracle(got: dict, epochs: int) -> list:
    """Every survivor holds the same record; each sample once per epoch; the model equals the one-process oracle."""
    record = got["0"]["record"]
    assert all(r["record"] == record for r in got.values())
    for epoch in range(epochs):
        ids = [i for e, _, step in record for i in step if e == epoch]
        assert ids == torch.randperm(loop.N, generator=torch.Generator().manual_seed(epoch)).tolist()
    for r in got.values():
        for have, want in zip(r["params"], loop.oracle(record), strict=True):
            torch.testing.assert_close(torch.tensor(have), want, rtol=1e-5, atol=1e-6)
    return record


def test_a_replacement_arriving_after_training_ended_leaves_the_job_finished(cluster, tmp_path):
    # Kill rank 1 before step 4; Ray's replacement r1 is held back (late=True) until both survivors wrote their
    # results, so its px.init() finds training over. That is the end of a finished job, not a failure.
    killed: list = []
    killer = threading.Thread(target=lambda: killed.extend(kill_when_parked(tmp_path, ["victim.json"])), daemon=True)
    killer.start()
    returned = train(worker.main, str(tmp_path), "1@4", 1, 2, 0, False, True, num_workers=3, min_workers=2,
                     heartbeat_s=20, max_failures=1)
    killer.join()
    got = results(tmp_path)
    assert sorted(got) == ["0", "2"] and killed[0]["id"] == "1", sorted(got)
    assert (tmp_path / "late-r1").exists()  # the replacement reached px.init() only after the others had finished
    record = check_exactly_once_and_oracle(got, epochs=1)
    assert [h["left"] for h in got["0"]["history"]] == [["1"]]
    assert returned == {"id": "0", "steps": len(record)}


def test_two_workers_killed_at_once_regroup_down_to_min_workers_and_finish(cluster, tmp_path):
    # Ranks 1 and 2 park before step 4 and are killed together: worker 0 goes on alone (min_workers=1), and Ray
    # replaces both; slow_below=3 makes worker 0 wait at each step until a replacement can be let in (offered a
    # place at the next commit point, or ready to enter at it), so both join before the end (the last loss and the
    # last join are not a race against Ray's start-up).
    killed: list = []
    names = ["victim1.json", "victim2.json"]
    killer = threading.Thread(target=lambda: killed.extend(kill_when_parked(tmp_path, names)), daemon=True)
    killer.start()
    returned = train(worker.main, str(tmp_path), "1,2@4", 2, 2, 3, num_workers=3, min_workers=1, heartbeat_s=20,
                     max_failures=2)
    killer.join()
    got = results(tmp_path)
    assert sorted(v["id"] for v in killed) == ["1", "2"]
    assert sorted(got) == ["0", "r1", "r2"], sorted(got)
    record = check_exactly_once_and_oracle(got, epochs=2)
    worlds = [w for _, w, _ in record]
    history = got["0"]["history"]
    assert sorted(history[0]["left"]) == ["1", "2"] and history[0]["step"] == 2  # both lost in one regroup
    assert sorted(j for h in history for j in h["joined"]) == ["r1", "r2"]
    assert worlds[:3] == [3, 3, 1] and worlds[-1] == 3, worlds
    assert returned == {"id": "0", "steps": len(record)}


def test_a_failed_run_is_one_line_naming_every_workers_failure_never_cut_at_a_colon():
    # Ray's messages are a heading ending in a colon, then the detail and tracebacks on later lines: the line
    # train() raises keeps the detail (it used to end at "Training failed due to worker errors:").
    from ray.exceptions import ActorDiedError
    from ray.train import ControllerError, WorkerGroupError

    from phalanx.launch.raytrain import one_line

    class Traced(Exception):  # what Ray returns for a training function's exception: its traceback as text
        def __str__(self) -> str:
            return 'Traceback (most recent call last):\n  File "train.py", line 9, in main\n    step()\nValueError: bad'

    err = WorkerGroupError("[Rank 1 Error Snippet]:\n...", {2: ActorDiedError(), 1: Traced()})
    line = one_line(err)
    assert line.startswith("WorkerGroupError: Ray Train rank 1: ValueError: bad; Ray Train rank 2: ActorDiedError: ")
    assert "\n" not in line and not line.endswith(":")
    line = one_line(ControllerError(ActorDiedError()))
    assert line.startswith("ControllerError: controller: ActorDiedError: The actor died") and "\n" not in line
