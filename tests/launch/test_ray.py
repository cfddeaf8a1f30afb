"""phalanx on Ray: a Ray cluster of 3 nodes on this machine (``ray.cluster_utils.Cluster``), real kills.

One cluster is shared by the module (Ray takes seconds to start). The training function
is tests/workers/ray_train.py: the same loop tests/elastic/test_elastic.py runs under
``phalanx run --elastic``; the oracle retrains one process on the global batches the
group recorded.
"""
from __future__ import annotations

import glob
import json
import os
import signal
import sys
import threading
import time

import pytest
import torch

from phalanx import ConfigError, PhalanxError
from phalanx.launch.raybackend import PhalanxConfig
from phalanx.launch.raytrain import _connect, require_ray

ray = pytest.importorskip("ray", reason="ray is not installed (pip install 'phalanx[ray]')")
pytest.importorskip("ray.train", reason="ray[train] is not installed (pip install 'phalanx[ray]')")

from phalanx.launch.raytrain import train  # noqa: E402
from support import ray_cluster  # noqa: E402
from workers import elastic as loop  # noqa: E402
from workers import ray_train as worker  # noqa: E402
from support.wait import until  # noqa: E402

cluster = ray_cluster.cluster  # the module's Ray cluster (a fixture)


def results(out) -> dict:
    return {json.load(open(p))["id"]: json.load(open(p)) for p in glob.glob(str(out / "worker*.json"))}


def kill_when_parked(out, timeout_s: float = 600.0) -> dict:
    """Wait for the victim to write its pid at the step it parks on, then SIGKILL its actor's process."""
    path = out / "victim.json"
    until(path.exists, timeout=timeout_s, what="the victim's pid file")
    victim = json.load(open(path))
    os.kill(victim["pid"], signal.SIGKILL)
    victim["killed_at"] = time.time()
    return victim


def test_kill_9_a_worker_actor_survivors_regroup_and_ray_replaces_it(cluster, tmp_path):
    killed: dict = {}
    killer = threading.Thread(target=lambda: killed.update(kill_when_parked(tmp_path)), daemon=True)
    killer.start()
    returned = train(worker.main, str(tmp_path), "1@4", 2, 2, 3, num_workers=3, min_workers=2, heartbeat_s=20)
    killer.join()
    got = results(tmp_path)
    # the survivors kept their processes (same pid as at the start); Ray's replacement r1 joined
    assert sorted(got) == ["0", "2", "r1"], sorted(got)
    assert killed["id"] == "1" and all(r["pid"] != killed["pid"] for r in got.values())
    starts = sorted(os.path.basename(p) for p in glob.glob(str(tmp_path / "start*")))
    assert starts == sorted([f"start1-{killed['pid']}"] + [f"start{k}-{r['pid']}" for k, r in got.items()])
    record = got["0"]["record"]
    assert all(r["record"] == record for r in got.values())
    for epoch in (0, 1):  # every sample exactly once per epoch, in the epoch's order
        ids = [i for e, _, step in record for i in step if e == epoch]
        assert ids == torch.randperm(loop.N, generator=torch.Generator().manual_seed(epoch)).tolist()
    worlds = [w for _, w, _ in record]
    history = got["0"]["history"]
    assert [h["left"] for h in history] == [["1"], []] and [h["joined"] for h in history] == [[], ["r1"]]
    # parked before step 4, so the others roll back to the commit of step 2: 3 workers, then 2, then 3 with r1
    assert worlds[:3] == [3, 3, 2] and worlds[-1] == 3 and history[0]["step"] == 2, worlds
    for r in got.values():  # the final model equals one process trained on the same global batches
        for have, want in zip(r["params"], loop.oracle(record), strict=True):
            torch.testing.assert_close(torch.tensor(have), want, rtol=1e-5, atol=1e-6)
    assert returned == {"id": "0", "steps": len(record)}


def test_room_for_a_third_worker_mid_run_grows_the_job_from_2_to_3_workers(cluster, tmp_path):
    # One CPU of the 3 nodes is held, so 2 workers fit; once both train it is let go, as a node added to the
    # cluster would offer it (Cluster.add_node itself only runs on the main thread, which train() holds), and
    # the controller starts a third worker there, which joins at a commit. slow_below=3: the 2 wait for it.
    hold = ray.remote(num_cpus=1)(ray_cluster.Holder).remote()
    ray.get(hold.ping.remote())

    def free_a_cpu() -> None:
        until(lambda: len(glob.glob(str(tmp_path / "start*"))) >= 2, timeout=600, what="the two workers' start files")
        ray.kill(hold)

    grower = threading.Thread(target=free_a_cpu, daemon=True)
    grower.start()
    try:
        returned = train(worker.main, str(tmp_path), "", 2, 2, 3, num_workers=2, max_workers=3, heartbeat_s=20)
    finally:
        grower.join()
    got = results(tmp_path)
    assert sorted(got) == ["0", "1", "g1"], sorted(got)
    record = got["0"]["record"]
    assert all(r["record"] == record for r in got.values())
    worlds = [w for _, w, _ in record]
    assert worlds[0] == 2 and worlds[-1] == 3 and worlds == sorted(worlds), worlds
    assert [(h["joined"], h["left"]) for h in got["0"]["history"]] == [(["g1"], [])]
    for epoch in (0, 1):  # every sample exactly once per epoch, across the growth
        ids = [i for e, _, step in record for i in step if e == epoch]
        assert ids == torch.randperm(loop.N, generator=torch.Generator().manual_seed(epoch)).tolist()
    for r in got.values():
        for have, want in zip(r["params"], loop.oracle(record), strict=True):
            torch.testing.assert_close(torch.tensor(have), want, rtol=1e-5, atol=1e-6)
    assert returned == {"id": "0", "steps": len(record)}


def test_without_ray_train_is_one_line_naming_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "ray.train", None)  # as if `ray` were installed without the [train] extra
    with pytest.raises(ConfigError, match=r"pip install 'phalanx\[ray\]'") as err:
        train(worker.main, "unused", num_workers=2)
    assert "\n" not in str(err.value)


def test_bad_input_is_one_line():
    with pytest.raises(ConfigError, match="num_workers=1"):
        PhalanxConfig(num_workers=1)
    with pytest.raises(ConfigError, match="min_workers=4 with num_workers=3"):
        PhalanxConfig(num_workers=3, min_workers=4)
    with pytest.raises(ConfigError, match="max_workers=2 with num_workers=2, spares=1"):
        PhalanxConfig(num_workers=2, spares=1, max_workers=2)
    require_ray()  # installed here


def test_an_unreachable_ray_address_is_one_line_within_seconds(monkeypatch):
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    started = time.monotonic()
    with pytest.raises(ConfigError, match="Ray address '127.0.0.1:1'") as err:
        _connect(ray, "127.0.0.1:1")
    assert "\n" not in str(err.value) and time.monotonic() - started < 15
    assert issubclass(ConfigError, PhalanxError)


def test_status_serves_the_same_page_under_ray(cluster, tmp_path, monkeypatch):
    # train(status=PORT): Ray Train's controller, which holds the job's store, serves the page of `phalanx run --status`
    import urllib.error
    import urllib.request

    from phalanx.monitor import token
    from phalanx.monitor.server import PAGE
    from support.procs import free_port

    monkeypatch.setenv("PHALANX_SECRET", "7a" * 32)  # the driver's secret: the page's token derives from it
    port, seen, done = free_port(), {"pages": [], "status": []}, threading.Event()

    def get(path: str, auth: bool = True) -> tuple[int, bytes]:
        headers = {"Authorization": f"Bearer {token('7a' * 32)}"} if auth else {}
        try:
            with urllib.request.urlopen(urllib.request.Request(f"http://127.0.0.1:{port}{path}", headers=headers),
                                        timeout=5) as r:
                return r.status, r.read()
        except urllib.error.HTTPError as err:
            return err.code, err.read()

    def watch() -> None:
        while not done.is_set():
            try:
                code, body = get("/status.json")
            except OSError:  # not serving yet, or gone
                done.wait(0.1)
                continue
            if code == 200:
                status = json.loads(body)
                seen["status"].append(status)
                if not seen["pages"]:
                    seen["pages"] = [get("/"), get("/", auth=False), get("/metrics", auth=False)]
                if status["ended"]:
                    return
            done.wait(0.2)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        returned = train(worker.main, str(tmp_path), "", 4, 2, num_workers=2, heartbeat_s=20, status=port)
    finally:
        watcher.join(timeout=30)
        done.set()
    assert returned["id"] == "0"
    page, anonymous, metrics = seen["pages"]
    assert page == (200, open(PAGE, "rb").read())  # the same page as under `phalanx run --status`
    assert anonymous == (401, b"") and metrics == (401, b"")
    # the page may be read before the group formed (no members yet); once it has members, they are the job's two
    assert seen["status"][-1]["members"] == ["0", "1"]
    assert all(s["members"] in ([], ["0", "1"]) for s in seen["status"]), [s["members"] for s in seen["status"]]
    last = seen["status"][-1]
    assert last["ended"]["code"] == 0 and last["ended"]["reason"] == "training finished"
    # each worker's last report, sent as it finished training (a Ray actor outlives the training function)
    assert [w["step"] for w in last["workers"]] == [returned["steps"]] * 2, last["workers"]
