"""phalanx on Ray: a Ray cluster of 3 nodes on this machine (``ray.cluster_utils.Cluster``), real kills.

One cluster is shared by the module (Ray takes seconds to start; the faults Ray Train mishandles are here too, so
that they share it: a replacement arriving after the end, two losses at once, a second loss while Ray Train's
controller is busy with the first, every holder of the state lost, the controller lost). Scenarios that end in a
finished job share Ray Train runs (module fixtures, one test per scenario): each run costs a controller and a worker
actor per worker (seconds of CPU each), a further fault in a run only the replacements it needs. ``three_faults``:
a kill, then two at once, then a second loss while replacing; ``grown_then_late``: the job grows, then loses a
worker whose replacement arrives after the end. Real kills: SIGKILL of
the worker actors' processes, placed by marker files the job writes. The training function is
tests/workers/ray_train.py: the same loop tests/elastic/test_elastic.py runs under ``phalanx run --elastic``; the
oracle retrains one process on the global batches the group recorded.
"""
from __future__ import annotations

import functools
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
from phalanx.errors import JobLostError
from phalanx.launch.raybackend import PhalanxConfig, data_parallel_trainer, training_function
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


def kill_when_parked(out, names: list[str], timeout_s: float = 600.0) -> list[dict]:
    """Wait until every victim has written its pid where it parks, then SIGKILL their processes back to back."""
    until(lambda: all((out / n).exists() for n in names), timeout=timeout_s, what="the victims' pid files")
    victims = [json.load(open(out / n)) for n in names]
    for v in victims:
        os.kill(v["pid"], signal.SIGKILL)
    return victims


def check_exactly_once_and_oracle(got: dict, epochs: int) -> list:
    """Every survivor holds the same record; each sample once per epoch; the model equals the one-process oracle."""
    record = got[min(got)]["record"]
    assert all(r["record"] == record for r in got.values())
    for epoch in range(epochs):
        ids = [i for e, _, step in record for i in step if e == epoch]
        assert ids == torch.randperm(loop.N, generator=torch.Generator().manual_seed(epoch)).tolist()
    for r in got.values():
        for have, want in zip(r["params"], loop.oracle(record), strict=True):
            torch.testing.assert_close(torch.tensor(have), want, rtol=1e-5, atol=1e-6)
    return record


@pytest.fixture(scope="module")
def grown_then_late(cluster, tmp_path_factory):
    """One Ray Train run for two scenarios: the job grows from 2 to 3 workers, then a worker is lost whose
    replacement arrives only after training ended (each Ray Train run costs a controller and worker actors).

    Growing (test_room_for_a_third_worker...): one CPU of the 3 nodes is held (a placement group: no process), so 2
    workers fit; once both train it is let go, as a node added to the cluster would offer it (Cluster.add_node
    itself only runs on the main thread, which train() holds), and the controller starts a third worker there, g1,
    which joins at a commit.
    slow_below=3 (slow_first: until that join): the 2 wait for it.

    Late replacement (test_a_replacement_arriving...): rank 1 parks at the first step from 6 on at which the three
    have trained a whole commit interval together (``1@6/3``: steps at 3 workers survive the rollback) and is
    killed; Ray's replacement r1 (in rank 1's slot: the placement group keeps its CPU, so the job does not grow
    instead) is held back (late=True) until the survivors wrote their results, so its px.init() finds training
    over. That is the end of a finished job, not a failure.
    """
    from ray.util.placement_group import placement_group, remove_placement_group

    out = tmp_path_factory.mktemp("grown_then_late")
    hold = placement_group([{"CPU": 1}])  # reserves the CPU without a process (an actor holding it cost a start)
    ray.get(hold.ready(), timeout=120)
    killed: list = []

    def free_a_cpu_then_kill() -> None:
        until(lambda: len(glob.glob(str(out / "start*"))) >= 2, timeout=600, what="the two workers' start files")
        remove_placement_group(hold)
        killed.extend(kill_when_parked(out, ["victim.json"]))

    thread = threading.Thread(target=free_a_cpu_then_kill, daemon=True)
    thread.start()
    fn = functools.partial(worker.main, slow_first=True)
    try:
        returned = train(fn, str(out), "1@6/3", 3, 2, 3, False, True, num_workers=2, max_workers=3, min_workers=1,
                         heartbeat_s=20, max_failures=1)
    finally:
        thread.join(timeout=60)
    got = results(out)
    return {"out": out, "got": got, "killed": killed, "returned": returned,
            "history": got["0"]["history"] if "0" in got else []}


def test_room_for_a_third_worker_mid_run_grows_the_job_from_2_to_3_workers(grown_then_late):
    got, history = grown_then_late["got"], grown_then_late["history"]
    assert sorted(got) == ["0", "g1"], sorted(got)  # rank 1 was lost after the growth (the late scenario)
    record = check_exactly_once_and_oracle(got, epochs=3)  # every sample once per epoch, across the growth
    worlds = [w for _, w, _ in record]
    assert [(h["joined"], h["left"]) for h in history[:1]] == [(["g1"], [])], history
    grown = worlds[:history[1]["step"]]  # the steps kept before the loss of the late scenario
    assert grown[0] == 2 and grown[-1] == 3 and grown == sorted(grown), worlds
    assert grown_then_late["returned"] == {"id": "0", "steps": len(record)}


def test_a_replacement_arriving_after_training_ended_leaves_the_job_finished(grown_then_late):
    got, history, killed = grown_then_late["got"], grown_then_late["history"], grown_then_late["killed"]
    assert [v["id"] for v in killed] == ["1"] and "r1" not in got, (killed, sorted(got))
    assert (grown_then_late["out"] / "late-r1").exists()  # r1 reached px.init() only after the others had finished
    record = check_exactly_once_and_oracle(got, epochs=3)
    assert [h["left"] for h in history] == [[], ["1"]], history  # the loss, and no join after it
    assert grown_then_late["returned"] == {"id": "0", "steps": len(record)}


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


def pid_of(out, name: str) -> int:
    return json.load(open(out / name))["pid"]


def steps(out) -> list[dict]:
    path = out / "steps.jsonl"
    return [json.loads(line) for line in open(path)] if path.exists() else []


def fit_held(out, fn, num_workers: int, min_workers: int, heartbeat_s: float, max_failures: int, armed: str = ""):
    """``train``'s trainer (raybackend.data_parallel_trainer), HeldConfig: replacements hold the controller (those
    started once ``out/<armed>`` exists, with ``armed``)."""
    from ray.train import FailureConfig, RunConfig, ScalingConfig

    cfg = worker.HeldConfig(num_workers=num_workers, min_workers=min_workers, heartbeat_s=heartbeat_s, out=str(out),
                            armed=armed)
    trainer = data_parallel_trainer(  # no test here loses this run's controller: no placement group to release
        training_function(fn), backend_config=cfg, pg_cleaner=False,
        scaling_config=ScalingConfig(num_workers=num_workers),
        run_config=RunConfig(failure_config=FailureConfig(max_failures=max_failures),
                             worker_runtime_env={"env_vars": cfg.worker_env()}))
    return trainer.fit().return_value


@pytest.fixture(scope="module")
def three_faults(cluster, tmp_path_factory):
    """One Ray Train run of 3 workers that sees three faults in sequence, each after the previous one's replacements
    joined: one run for three scenarios (each Ray Train run costs a controller and three worker actors, seconds of
    CPU each; a phase here costs only the replacements it needs). slow_below=3: while fewer than 3 train, each step
    waits until a replacement can enter, so every replacement joins before the next phase and the end.

    Phase 1 (test_kill_9...): rank 1 parks before step 4 and is SIGKILLed; the survivors 0 and 2 regroup (rolled
    back to the commit of step 2) and Ray's replacement r1 joins.

    Phase 2 (test_two_workers_killed_at_once...): 2 and r1 park at the first step from 8 on at which all three
    train (``2,r1@8/3``) and are killed together: worker 0 goes on alone (min_workers=1), and Ray replaces both
    (r2, r3).

    Phase 3 (test_a_second_loss...): r2 parks once r2 and r3 both train (``r2@8/3``); the test arms the hold
    (``armed``) and kills it. Ray Train's controller starts its replacement and is held there (HeldConfig), as a
    start of tens of seconds on a loaded machine holds it: it sees no other loss meanwhile. r3 is killed as it enters
    the regroup the loss caused. Worker 0 must regroup alone at once (the heartbeat watcher finds r3's actor dead),
    not wait out its quorum and fail with the state (the chaos soak's wedge). The survivors enter that regroup once
    the controller is held, so the quorum's bound counts from there. Ray replaces both (r4, r5).
    """
    out = tmp_path_factory.mktemp("three_faults")
    heartbeat_s = 20
    run: dict = {"killed": [], "regrouped": []}

    def kill() -> None:
        run["killed"].append(kill_when_parked(out, ["victim.json"]))
        run["killed"].append(kill_when_parked(out, ["victim2.json", "victimr1.json"]))
        until(lambda: (out / "victimr2.json").exists(), timeout=600, what="r2 parked for phase 3")
        (out / "armed").touch()  # before its kill: its replacement's start holds the controller, the regroup waits
        third = kill_when_parked(out, ["victimr2.json"])
        until(lambda: (out / "controller-held").exists() and (out / "victim-regroup.json").exists(),
              timeout=300, what="the held controller and r3 inside its regroup")
        run["killed"].append(third + [json.load(open(out / "victim-regroup.json"))])
        os.kill(pid_of(out, "victim-regroup.json"), signal.SIGKILL)
        killed_at = time.time()
        try:  # worker 0's next step, within its quorum's bound (heartbeat + 10 s) and a margin
            until(lambda: any(s["id"] == "0" and s["t"] > killed_at for s in steps(out)),
                  timeout=heartbeat_s + 25, what="worker 0's step after the second loss")
            run["regrouped"].append(True)
        except AssertionError:
            run["regrouped"].append(False)
        (out / "release-controller").touch()

    killer = threading.Thread(target=kill, daemon=True)
    killer.start()
    fn = functools.partial(worker.main, str(out), "1@4;2,r1@8/3;r2@8/3", 4, 2, 3, regroup_victim="r3",
                           regroup_armed="armed", slow_for=400)
    run["error"] = None
    try:
        run["returned"] = fit_held(out, fn, num_workers=3, min_workers=1, heartbeat_s=heartbeat_s, max_failures=5,
                                   armed="armed")
    except Exception as err:  # noqa: BLE001 - each scenario's test says where the run ended (phases reached)
        run["error"] = f"the run failed after {len(run['killed'])} of 3 phases' kills: {type(err).__name__}: {err}"
    finally:
        (out / "release-controller").touch()  # a killer still waiting must not hold the controller past the run
    killer.join(timeout=60)
    got = results(out)
    run["got"], run["out"], run["history"] = got, out, got["0"]["history"] if "0" in got else []
    return run


def regroup(history: list[dict], lost: str) -> tuple[int, dict]:
    """The index and entry of the regroup in which worker ``lost`` left."""
    found = [(i, h) for i, h in enumerate(history) if lost in h["left"]]
    assert len(found) == 1, (lost, history)
    return found[0]


def joined_between(history: list[dict], start: int, end: int) -> list[str]:
    return sorted(j for h in history[start:end] for j in h["joined"])


def test_kill_9_a_worker_actor_survivors_regroup_and_ray_replaces_it(three_faults):
    assert three_faults["error"] is None, three_faults["error"][:3000]
    got, killed, history = three_faults["got"], three_faults["killed"], three_faults["history"]
    out = three_faults["out"]
    assert [v["id"] for v in killed[0]] == ["1"], killed
    # the survivor kept its process (same pid as at the start); every worker that started and was not killed wrote
    # its result (Ray's replacements r1-r3 were themselves lost in the later phases)
    assert sorted(got) == ["0", "r4", "r5"], sorted(got)
    victims = [v for phase in killed for v in phase]
    assert all(r["pid"] != v["pid"] for r in got.values() for v in victims)
    starts = sorted(os.path.basename(p) for p in glob.glob(str(out / "start*")))
    assert starts == sorted([f"start{v['id']}-{v['pid']}" for v in victims]
                            + [f"start{k}-{r['pid']}" for k, r in got.items()]), starts
    record = check_exactly_once_and_oracle(got, epochs=4)  # every sample once per epoch, in the epoch's order
    worlds = [w for _, w, _ in record]
    # phase 1: 1 left alone, then r1 joined alone
    assert [h["left"] for h in history[:2]] == [["1"], []] and [h["joined"] for h in history[:2]] == [[], ["r1"]]
    # parked before step 4, so the others roll back to the commit of step 2: 3 workers, then 2, then 3 with r1
    assert worlds[:3] == [3, 3, 2] and history[0]["step"] == 2 and history[1]["world_size"] == 3, worlds
    assert worlds[-1] == 3, worlds
    assert three_faults["returned"] == {"id": "0", "steps": len(record)}


def test_two_workers_killed_at_once_regroup_down_to_min_workers_and_finish(three_faults):
    assert three_faults["error"] is None, three_faults["error"][:3000]
    got, killed, history = three_faults["got"], three_faults["killed"], three_faults["history"]
    assert sorted(v["id"] for v in killed[1]) == ["2", "r1"], killed
    record = check_exactly_once_and_oracle(got, epochs=4)
    worlds = [w for _, w, _ in record]
    at, h = regroup(history, "2")
    assert sorted(h["left"]) == ["2", "r1"] and h["world_size"] == 1, h  # both lost in one regroup, down to 1
    # 3 workers when they were lost; rolled back to the commit of the regroup, then worker 0 alone
    assert h["was"] == 3 and worlds[h["step"]] == 1, (h, worlds)
    # Ray replaced both, and both joined before the next loss
    after, _ = regroup(history, "r2")
    assert joined_between(history, at + 1, after) == ["r2", "r3"], history
    assert history[after - 1]["world_size"] == 3, history
    assert three_faults["returned"] == {"id": "0", "steps": len(record)}


def test_a_second_loss_while_ray_train_replaces_the_first_is_survived(three_faults):
    got, killed, history = three_faults["got"], three_faults["killed"], three_faults["history"]
    # worker 0 regrouped alone within its quorum's bound ([]: the run ended before this phase)
    assert three_faults["regrouped"] == [True], three_faults["error"]
    assert three_faults["error"] is None, three_faults["error"][:3000]
    assert [v["id"] for v in killed[2]] == ["r2", "r3"], killed
    assert sorted(got) == ["0", "r4", "r5"], sorted(got)
    record = check_exactly_once_and_oracle(got, epochs=4)
    at, h = regroup(history, "r2")
    assert sorted(h["left"]) == ["r2", "r3"] and h["world_size"] == 1, h
    assert joined_between(history, at + 1, len(history)) == ["r4", "r5"], history
    assert three_faults["returned"] == {"id": "0", "steps": len(record)}


def test_every_holder_of_the_state_lost_ends_the_job_with_one_line_naming_the_newest_checkpoint(cluster, tmp_path):
    # Rank 1 is killed before step 4; its replacement r1 is held before px.init(). Rank 0, the last holder of the
    # state, is killed before step 8 while r1 lives. r1 (released then) and Ray's next replacements would wait
    # for a state nobody holds: the job ends at once with one line naming the newest checkpoint (step 6). Two
    # workers: a live worker that holds no state (r1) beside the lost holders is the case (a third worker would
    # add a worker start, nothing more; two holders lost at once are test_two_workers_killed_at_once...).
    def kill() -> None:
        kill_when_parked(tmp_path, ["victim.json"])
        kill_when_parked(tmp_path, ["victim0.json"])
        (tmp_path / "release-replacements").touch()

    killer = threading.Thread(target=kill, daemon=True)
    killer.start()
    fn = functools.partial(worker.main, checkpoint=str(tmp_path / "ckpt"), save_every=3, hold_replacements=True)
    with pytest.raises(JobLostError) as err:
        train(fn, str(tmp_path), "1@4;0@8", 2, 2, num_workers=2, min_workers=1, heartbeat_s=20, max_failures=5)
    killer.join()
    newest = max(int(p.name.split("-")[1]) for p in tmp_path.glob("saved-*"))
    assert newest == 6
    assert err.value.checkpoint == str(tmp_path / "ckpt" / "step-6")
    line = str(err.value)
    assert "\n" not in line and "every worker that held the training state (0, generation" in line, line
    assert f"resume_from_checkpoint={err.value.checkpoint!r}" in line, line


def controller_pid() -> int:
    """The pid of the live Ray Train controller of this driver's job (one at a time in these tests)."""
    import ray._private.state as state

    job = ray.get_runtime_context().get_job_id()
    alive = [a for a in state.actors(actor_state_name="ALIVE").values()
             if a["ActorClassName"] == "TrainController" and a["JobID"] == job]
    assert len(alive) == 1, alive
    return int(alive[0]["Pid"])


class PageWatcher:
    """Reads the status page of ``train(status=port)`` while it serves: the first pages, then every status."""

    SECRET = "7a" * 32  # the driver's secret (PHALANX_SECRET): the page's token derives from it

    def __init__(self, port: int) -> None:
        self.port, self.pages, self.status, self.done = port, [], [], threading.Event()
        self.thread = threading.Thread(target=self.watch, daemon=True)

    def get(self, path: str, auth: bool = True) -> tuple[int, bytes]:
        import urllib.error
        import urllib.request

        from phalanx.monitor import token

        headers = {"Authorization": f"Bearer {token(self.SECRET)}"} if auth else {}
        try:
            with urllib.request.urlopen(urllib.request.Request(f"http://127.0.0.1:{self.port}{path}",
                                                               headers=headers), timeout=5) as r:
                return r.status, r.read()
        except urllib.error.HTTPError as err:
            return err.code, err.read()

    def watch(self) -> None:
        while not self.done.is_set():
            try:
                code, body = self.get("/status.json")
            except OSError:  # not serving yet, or gone
                self.done.wait(0.1)
                continue
            if code == 200:
                status = json.loads(body)
                self.status.append(status)
                if not self.pages:
                    self.pages = [self.get("/"), self.get("/", auth=False), self.get("/metrics", auth=False)]
                if status["ended"]:
                    return
            self.done.wait(0.2)


@pytest.fixture(scope="module")
def controller_lost_then_resumed(cluster, tmp_path_factory):
    """One job whose controller is SIGKILLed, then a new run from the checkpoint its line names, serving the page.

    Both workers park before step 9 (after the first run's only checkpoint, step 8); Ray Train's controller, which
    holds the job's store, is SIGKILLed; train() raises one line naming step-8. The new run from it
    (resume_from_checkpoint) trains the rest with ``status=PORT``: Ray Train's controller serves the page of
    ``phalanx run --status`` (a resumed run is a run like any other to the page). Two workers: the controller's loss
    is the job's whatever the workers' number (a third would add a worker start to each run, nothing more).
    """
    from support.procs import free_port

    tmp_path = tmp_path_factory.mktemp("controller")
    first, second = tmp_path / "first", tmp_path / "second"
    first.mkdir(), second.mkdir()
    killed: list = []

    def kill() -> None:
        until(lambda: all((first / f"victim{i}.json").exists() for i in "01"), timeout=300, what="the parked workers")
        time.sleep(1.5)  # sleep: the driver reads the newest checkpoint from the store every 0.5 s (raytrain._Ledger)
        os.kill(controller_pid(), signal.SIGKILL)
        killed.append(time.time())

    killer = threading.Thread(target=kill, daemon=True)
    killer.start()
    ckpt = str(tmp_path / "ckpt")
    with pytest.raises(JobLostError) as err:
        train(functools.partial(worker.main, checkpoint=ckpt, save_every=4), str(first), "0,1@9", 3, 2,
              num_workers=2, min_workers=1, heartbeat_s=20, max_failures=0)
    killer.join()
    watcher = PageWatcher(free_port())
    watcher.thread.start()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PHALANX_SECRET", PageWatcher.SECRET)
        try:
            returned = train(functools.partial(worker.main, checkpoint=ckpt, save_every=4), str(second), "", 3, 2,
                             num_workers=2, min_workers=1, heartbeat_s=20, max_failures=0,
                             resume_from_checkpoint=err.value.checkpoint, status=watcher.port)
        finally:
            watcher.thread.join(timeout=30)
            watcher.done.set()
    resumed = min(s["t"] for s in steps(second))
    print(f"from the controller's kill to the first resumed step: {resumed - killed[0]:.1f}s")
    return {"err": err.value, "ckpt": ckpt, "returned": returned, "got": results(second), "watcher": watcher}


def test_the_controller_killed_ends_the_job_naming_the_newest_checkpoint_and_a_resume_from_it_is_exact(
        controller_lost_then_resumed):
    # The new run from the checkpoint the line named trains the rest: every sample once per epoch over the two runs,
    # and the final model equals the one-process oracle replayed from the record the checkpoint carried on.
    run = controller_lost_then_resumed
    line = str(run["err"])
    assert run["err"].checkpoint == os.path.join(run["ckpt"], "step-8"), line
    assert "\n" not in line and "Ray Train's controller, which held the job's store, was lost" in line, line
    got, returned = run["got"], run["returned"]
    assert sorted(got) == ["0", "1"]
    record = check_exactly_once_and_oracle(got, epochs=3)
    assert len(record) > 8 and returned["id"] == "0"


def test_status_serves_the_same_page_under_ray(controller_lost_then_resumed):
    # train(status=PORT): Ray Train's controller, which holds the job's store, serves the page of `phalanx run --status`
    from phalanx.monitor.server import PAGE

    returned, watcher = controller_lost_then_resumed["returned"], controller_lost_then_resumed["watcher"]
    assert returned["id"] == "0"
    page, anonymous, metrics = watcher.pages
    assert page == (200, open(PAGE, "rb").read())  # the same page as under `phalanx run --status`
    assert anonymous == (401, b"") and metrics == (401, b"")
    # the page may be read before the group formed (no members yet); once it has members, they are the job's two
    seen = watcher.status
    assert seen[-1]["members"] == ["0", "1"]
    assert all(s["members"] in ([], ["0", "1"]) for s in seen), [s["members"] for s in seen]
    last = seen[-1]
    assert last["ended"]["code"] == 0 and last["ended"]["reason"] == "training finished"
    # each worker's last report, sent as it finished training (a Ray actor outlives the training function)
    assert [w["step"] for w in last["workers"]] == [returned["steps"]] * 2, last["workers"]
