"""The Ray Train backend of :func:`phalanx.launch.raytrain.train`: the job it hosts in Ray Train's controller
(store, secret, heartbeat watcher, growing) and what each worker runs.

The Ray Train backend here (:class:`PhalanxConfig`) is Ray Train's own extension point for
a distributed backend. It declares its workers *replica groups* of one
(``Backend.has_replica_groups``, Ray 2.60): when a worker dies, Ray Train's controller
replaces that one worker in its placement-group slot and leaves the others running,
instead of restarting the whole group from a checkpoint. phalanx does the rest with the
machinery of ``phalanx run --elastic``: the survivors keep their processes and state,
rebuild the group without the lost worker and roll back to the newest in-memory commit
they all hold; the replacement enters at the next commit with rank 0's state.

The job's store (and its secret) live in Ray Train's controller actor, which Ray pins to
the node of the driver (``trainer.fit()``'s caller), not on any worker: a lost worker,
rank 0 included, never takes it along. The controller writes what Ray's fault detection
sees into it (``elastic/dead/<id>`` when a worker's actor died), as the launcher of
``phalanx run --elastic`` does for its processes. Its heartbeat watcher also asks Ray about a
worker whose heartbeat stood still 1.5 s, and marks a dead actor at once: Ray Train's controller
sees a loss only between its own steps, and starting a replacement (tens of seconds on a busy
machine) is one of them, so a second loss during a replacement would otherwise reach the
survivors' quorum too late.

Several workers lost in the same instant are replaced one by one, the survivors going on down to
``min_workers``. A replacement that Ray starts after the survivors finished returns None at once
(:func:`training_function`): the job is finished, and ``train`` returns rank 0's value.

Growing: with ``max_workers`` above ``num_workers + spares``, the controller watches the
cluster's free resources; when a node is added (room for one more worker's
``resources_per_worker``), it starts the training function in a new Ray actor there, which
joins at the next commit with rank 0's state, as ``phalanx join`` does. Ray Train itself would
restart every worker from a checkpoint to resize; these extra workers are phalanx's, outside
Ray Train's worker group (its return value is rank 0's, as before).

Example:
    >>> PhalanxConfig(min_workers=2).heartbeat_s
    10.0
"""
from __future__ import annotations

import json
import os
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from ..elastic import secret
from ..elastic.membership import key
from ..elastic.watch import mark_dead
from ..elastic.admission import EndedBeforeAdmitted
from ..errors import ConfigError, JobLostError, usage
from .elastic import _members, generation_members, listening_store, quiet_store_env, saved_checkpoint
from .stacks import Watchdog
from .status import JobStatus, stacks_button

try:  # Ray is an extra (`pip install 'phalanx[ray]'`); without it this module imports and train() says so
    from ray.train.backend import Backend, BackendConfig
except ImportError:  # pragma: no cover - exercised where ray is absent
    Backend = BackendConfig = object  # type: ignore[misc,assignment]


@dataclass
class PhalanxConfig(BackendConfig):  # type: ignore[misc]
    """Ray Train's backend config for phalanx: pass it as ``backend_config`` to a ``DataParallelTrainer``.

    Args:
        num_workers: the workers that train from the start (Ray Train starts ``num_workers + spares``).
        min_workers: fewer survivors than this end the job (default: more than half of ``num_workers``).
        spares: parked workers that take a lost worker's place at the regroup.
        heartbeat_s: a worker whose heartbeat stops this long is killed (Ray then replaces it).
        threads: intra-op threads per worker.
        timeout_s: the bound on every collective (``px.init(timeout=...)``'s default).
        max_workers: the group may grow to this many when the cluster gains room (default: no growth).
    """

    num_workers: int = 2
    min_workers: int | None = None
    spares: int = 0
    heartbeat_s: float = 10.0
    threads: int = 1
    timeout_s: float | None = None
    debug: bool = False
    host: str | None = None  # where the store listens: the controller's node address by default
    port: int = 0  # where the store listens (0: any free port); train() picks one so the driver can read the store
    extra_env: dict[str, str] = field(default_factory=dict)
    max_workers: int | None = None
    grow: Callable[[], Any] | None = None  # the training function, for the workers started when a node is added
    resources: dict[str, float] | None = None  # one worker's Ray resources (the room a new worker needs)
    status: tuple[str, int] | None = None  # `status=`: the controller serves the status page there (phalanx.monitor)
    secret: str | None = field(default=None, repr=False)  # the job's secret, made by the driver (None: the controller)

    def __post_init__(self) -> None:
        n = self.num_workers
        if isinstance(n, bool) or not isinstance(n, int) or n < 2:
            raise ConfigError(usage(f"num_workers={n!r}", "an integer >= 2 (one worker has no one to survive)",
                                    "Pass e.g. num_workers=3, min_workers=2."))
        low = n // 2 + 1 if self.min_workers is None else self.min_workers
        if isinstance(low, bool) or not isinstance(low, int) or not 1 <= low <= n:
            raise ConfigError(usage(f"min_workers={self.min_workers!r} with num_workers={n}",
                                    f"an integer from 1 to {n}", f"Pass e.g. min_workers={n - 1}."))
        self.min_workers = low
        if isinstance(self.spares, bool) or not isinstance(self.spares, int) or self.spares < 0:
            raise ConfigError(usage(f"spares={self.spares!r}", "an integer >= 0",
                                    "Pass e.g. spares=1, or leave it out."))
        if not float(self.heartbeat_s) > 0:
            raise ConfigError(usage(f"heartbeat_s={self.heartbeat_s!r}", "a positive number of seconds",
                                    "Pass e.g. heartbeat_s=10."))
        top = self.max_workers if self.max_workers is not None else self.total_workers
        if isinstance(top, bool) or not isinstance(top, int) or top < self.total_workers:
            raise ConfigError(usage(f"max_workers={self.max_workers!r} with num_workers={n}, spares={self.spares}",
                                    f"an integer >= {self.total_workers}", f"Pass e.g. max_workers={n + 1}."))
        self.max_workers = top
        if isinstance(self.threads, bool) or not isinstance(self.threads, int) or self.threads < 1:
            raise ConfigError(usage(f"threads={self.threads!r}", "an integer >= 1", "Pass e.g. threads=1."))
        if self.timeout_s is not None and not float(self.timeout_s) > 0:
            raise ConfigError(usage(f"timeout_s={self.timeout_s!r}", "a positive number of seconds",
                                    "Pass e.g. timeout_s=60, or leave it out."))

    @property
    def backend_cls(self) -> type:
        return _PhalanxBackend

    @property
    def total_workers(self) -> int:
        """The workers Ray Train starts: members and spares."""
        return self.num_workers + self.spares

    def worker_env(self) -> dict[str, str]:
        """Variables every worker process needs before torch starts (Ray's worker runtime env)."""
        env = {"OMP_NUM_THREADS": str(self.threads), "PHALANX_THREADS": str(self.threads),
               **quiet_store_env(self.debug), **self.extra_env}
        if self.timeout_s is not None:
            env["PHALANX_TIMEOUT"] = repr(float(self.timeout_s))
        if self.debug:
            env["PHALANX_DEBUG"] = "1"
        if self.status is not None:  # the workers report their steps to the page (phalanx.step.telemetry)
            env["PHALANX_STATUS"] = "1"
        return env


class _Job:
    """One elastic job's store and secret, hosted in the Ray Train controller (the driver's node)."""

    def __init__(self, cfg: PhalanxConfig) -> None:
        import ray

        self.host = cfg.host or ray.util.get_node_ip_address()
        self.store = listening_store(self.host, cfg.port)
        self.secret, nonce = cfg.secret or secret.make(), secret.nonce()
        self.heartbeat_s = float(cfg.heartbeat_s)
        self.ids = {r: str(r) for r in range(cfg.num_workers)}  # Ray Train's world rank (its slot) -> worker id
        self.ids.update({cfg.num_workers + i: f"s{i}" for i in range(cfg.spares)})
        self.spares = [f"s{i}" for i in range(cfg.spares)]
        self.replaced = 0
        self.actors: dict[str, Any] = {}  # worker id -> its actor, for the hang watcher
        self.store.set(key("config"), json.dumps({
            "min_workers": cfg.min_workers, "max_workers": cfg.max_workers, "heartbeat_s": self.heartbeat_s,
            "workers": cfg.num_workers, "spares": self.spares, "nonce": nonce,
            "check": secret.verifier(self.secret, nonce)}))
        self.store.set(key("gen", 0, "members"), json.dumps([self.ids[r] for r in range(cfg.num_workers)]))
        self.status: JobStatus | None = None
        if cfg.status is not None:  # the page is served where the store is: this controller (the driver's node)
            self.status = JobStatus.bind(*cfg.status)
            self.status.attach(self.store, members=generation_members, secret=self.secret, announce=False,
                               checkpoint=lambda s: saved_checkpoint(s, generation_members(s)[0]))
            self.status.action("stacks", stacks_button(self.host, self.store.port, self.secret))
        self.ended: JobLostError | None = None  # set when every holder of the training state was lost
        self.stopped = threading.Event()
        self.probes: dict[str, tuple[Any, float]] = {}  # worker id -> (a liveness call to its actor, when sent)
        self.watcher = threading.Thread(target=self._watch_heartbeats, name="phalanx-ray-heartbeats", daemon=True)
        self.watcher.start()
        self.grown: dict[str, tuple[Any, Any]] = {}  # worker id -> (actor, its run's result), see _grow
        self.grew = 0
        if cfg.max_workers > cfg.total_workers and cfg.grow is not None:
            threading.Thread(target=self._grow, args=(cfg,), name="phalanx-ray-grow", daemon=True).start()

    def env(self, slot: int, joining: bool, local_rank: int, local_world: int, num_workers: int) -> dict[str, str]:
        """What the worker in Ray's ``slot`` gets: the variables ``phalanx run --elastic`` gives its workers."""
        return self.worker_env(self.ids[slot], joining, {
            "RANK": str(slot), "WORLD_SIZE": str(num_workers), "LOCAL_RANK": str(local_rank),
            "LOCAL_WORLD_SIZE": str(local_world)})

    def worker_env(self, wid: str, joining: bool, ranks: dict[str, str]) -> dict[str, str]:
        """Worker ``wid``'s variables: the job's store and secret, and its ranks unless it joins."""
        env = {"MASTER_ADDR": self.host, "MASTER_PORT": str(self.store.port), "PHALANX_ELASTIC_ID": wid,
               "TORCHELASTIC_USE_AGENT_STORE": "true", "TORCHELASTIC_RESTART_COUNT": "0", secret.ENV: self.secret,
               "PHALANX_LAUNCHER": "ray"}
        if joining:
            env["PHALANX_ELASTIC_JOIN"] = "1"
        else:
            env.update(ranks)
        return env

    def _grow(self, cfg: PhalanxConfig, poll_s: float = 0.5) -> None:
        """Start one more worker (a joiner, in its own actor) whenever the cluster has room for it."""
        import ray

        need = dict(cfg.resources or {"CPU": 1.0})
        runner = ray.remote(_Grown)
        while not self.stopped.wait(poll_s):
            try:
                if self.store.check([key("done")]):
                    return
                for wid, (_, ref) in list(self.grown.items()):  # a grown worker that failed: tell the quorum
                    if ray.wait([ref], timeout=0)[0]:
                        try:
                            ray.get(ref)
                        except Exception as err:  # noqa: BLE001 - its actor or function failed: it is lost
                            self.actors.pop(wid, None)
                            if not self.store.check([key("finished", wid)]):
                                mark_dead(self.store, wid, f"was lost ({type(err).__name__})")
                        del self.grown[wid]
                alive = sum(1 for wid in self.grown if not self.store.check([key("finished", wid)]))
                free = ray.available_resources()
                if cfg.total_workers + alive >= cfg.max_workers or any(free.get(k, 0.0) < v
                                                                         for k, v in need.items()):
                    continue
                self.grew += 1
                wid = f"g{self.grew}"
                env = {**cfg.worker_env(), **self.worker_env(wid, True, {})}
                actor = runner.options(num_cpus=need.get("CPU", 0.0),
                                       resources={k: v for k, v in need.items() if k not in ("CPU", "GPU")},
                                       num_gpus=need.get("GPU", 0.0), runtime_env={"env_vars": env}).remote()
                self.grown[wid] = (actor, actor.run.remote(cfg.grow))
                self.actors[wid] = actor  # the heartbeat watcher covers it too
                print(f"phalanx: ray: the cluster has room for one more worker; started {wid}, which joins at "
                      "the next commit", file=sys.stderr, flush=True)
            except Exception:  # noqa: BLE001 - the store is closing with the job
                return

    def replace(self, slot: int) -> str:
        """A new id for the worker Ray started in ``slot`` in place of a lost one: it joins at the next commit."""
        self.replaced += 1
        self.ids[slot] = f"r{self.replaced}"
        return self.ids[slot]

    def lost(self, slot: int, how: str) -> None:
        """Ray saw the worker of ``slot`` fail: tell the survivors' quorum (``elastic/dead/<id>``) at once."""
        self.lose(self.ids[slot], how, f" (Ray Train rank {slot})")

    def lose(self, wid: str, how: str, where: str = "") -> None:
        """Worker ``wid`` is gone: mark it dead for the quorum (once; whoever saw it first, Ray or the watcher)."""
        self.actors.pop(wid, None)
        self.probes.pop(wid, None)
        if self.store.check([key("dead", wid)]):
            return  # told already (the heartbeat watcher sees a dead actor before Ray Train's controller may)
        if self.store.check([key("finished", wid)]):
            return  # it had finished training; its actor going is no loss
        mark_dead(self.store, wid, how)
        if not self.store.check([key("done")]):
            print(f"phalanx: ray: worker {wid}{where} {how}; the others regroup without it, "
                  "and Ray starts a replacement that joins at the next commit", file=sys.stderr, flush=True)

    def newest_checkpoint(self) -> str | None:
        """The newest checkpoint ``px.save_checkpoint`` wrote in this job (None: none)."""
        return saved_checkpoint(self.store, generation_members(self.store)[0])

    def state_lost(self) -> JobLostError | None:
        """Every member of the newest generation is dead and training did not finish: nobody holds the state.

        The replacements Ray starts could only wait to be handed a state nobody holds: the job ends instead,
        with one line naming the newest checkpoint (None while a member lives)."""
        if self.store.check([key("done")]):
            return None
        generation, members = generation_members(self.store)
        if not members or not all(self.store.check([key("dead", m)]) for m in members):
            return None
        return lost_state_error(f"every worker that held the training state ({', '.join(members)}, generation "
                                f"{generation}) was lost, so the replacements Ray starts have nobody to take it "
                                "from", self.newest_checkpoint())

    def _watch_heartbeats(self, poll_s: float = 0.5) -> None:
        """Kill a worker whose heartbeat stopped (a hang gloo cannot free its peers from); Ray then replaces it."""
        import ray

        seen: dict[str, tuple[int, float]] = {}
        # every worker's stacks when the group stops stepping, and before a hung worker is killed (launch/stacks.py)
        self.dog = Watchdog(self.store, self.secret, self.heartbeat_s, expect=lambda: _members(self.store),
                            lost=lambda: [w for w in self.ids.values() if self.store.check([key("dead", w)])],
                            epoch=lambda: self.store.get(key("gen")) if self.store.check([key("gen")]) else b"0")
        while not self.stopped.wait(poll_s):
            now = time.monotonic()
            self._look_for_stalls(silent=[w for w, (beats, t) in seen.items() if beats and now - t > 1.5])
            try:
                for wid, actor in list(self.actors.items()):
                    if self.store.check([key("finished", wid)]) or self.store.check([key("dead", wid)]):
                        continue
                    beats, now = int(self.store.add(key("hb", wid), 0)), time.monotonic()
                    last = seen.get(wid)
                    if last is None or last[0] != beats or not beats:
                        seen[wid] = (beats, now)
                        self.probes.pop(wid, None)
                    elif now - last[1] > self.PROBE_AFTER_S and self._died(wid, actor, now):
                        # its actor is dead: tell the quorum now, not when Ray Train's controller gets to it (it
                        # may be busy starting another worker's replacement for as long as the quorum waits)
                        self.lose(wid, "was lost (its Ray actor died)")
                    elif now - last[1] > self.heartbeat_s:
                        self._look_for_stalls(wid, f"sent no heartbeat for {now - last[1]:.1f}s (hung or stopped)")
                        print(f"phalanx: ray: worker {wid} sent no heartbeat for {now - last[1]:.1f}s (hung or "
                              "stopped); killing its actor", file=sys.stderr, flush=True)
                        self.actors.pop(wid, None)
                        ray.kill(actor)
                        self.lose(wid, f"was killed (no heartbeat for {now - last[1]:.1f}s)")
            except Exception:  # noqa: BLE001 - the store is closing with the job
                return

    PROBE_AFTER_S = 1.5  # a worker's heartbeat (every 0.5 s) still this long: ask Ray whether its actor lives

    def _died(self, wid: str, actor: Any, now: float) -> bool:
        """Is ``wid``'s actor dead? One liveness call in flight per silent worker, looked at without blocking."""
        import ray

        sent = self.probes.get(wid)
        if sent is None:
            self.probes[wid] = (actor.__ray_ready__.remote(), now)
            return False
        ref, at = sent
        if not ray.wait([ref], timeout=0)[0]:
            return False  # no answer yet: a busy actor, or one Ray has not found dead yet
        try:
            ray.get(ref, timeout=0)
        except ray.exceptions.RayActorError:
            return True
        except Exception:  # noqa: BLE001 - not known dead: the heartbeat timeout decides
            pass
        if now - at > self.PROBE_AFTER_S:  # it answered, so it lives (silent for another reason): ask again later
            self.probes[wid] = (actor.__ray_ready__.remote(), now)
        return False

    def _look_for_stalls(self, killing: str | None = None, why: str = "", silent: list[str] | None = None) -> None:
        """The watchdog's look (or, before ``killing`` a worker, its stacks); never ends the heartbeat watcher.

        ``silent``: workers whose heartbeat stood still a while, not waited for."""
        try:
            if killing is None:
                self.dog.poll(silent=silent or [])
            else:
                self.dog.before_kill(killing, why)
        except Exception:  # noqa: BLE001 - the store is closing with the job; the hang watcher goes on
            pass

    def close(self) -> None:
        import ray

        from ..elastic.membership import key

        self.stopped.set()
        note = self.dog.end_note() if getattr(self, "dog", None) is not None else None
        if note:
            print(note, file=sys.stderr, flush=True)
        if self.grown:
            try:  # training is over: let the grown workers return (they finish with the others), then end them
                if self.store.check([key("done")]):
                    ray.wait([ref for _, ref in self.grown.values()], num_returns=len(self.grown), timeout=30)
            except Exception:  # noqa: BLE001 - the store or Ray is going away with the job
                pass
            for actor, _ in self.grown.values():
                ray.kill(actor)
        if self.status is not None:
            try:
                done = self.store.check([key("done")])
            except Exception:  # noqa: BLE001 - the store is closing with the job
                done = False
            self.status.end(0 if done else 1, "training finished" if done else "Ray Train ended the worker group")


class _Grown:
    """A worker started outside Ray Train's worker group when the cluster gained room (a Ray actor)."""

    def run(self, fn: Callable[[], Any]) -> Any:
        return fn()


def training_function(fn: Callable[..., Any], *args: Any) -> Callable[[], Any]:
    """What each Ray worker runs: ``fn(*args)``; a replacement that arrives after training ended returns None.

    Its ``px.init()`` raises :class:`~phalanx.elastic.admission.EndedBeforeAdmitted` (status 0 under
    ``phalanx run``); in a Ray actor, which lives on, Ray Train would count that exception as a worker
    error and retry a job that had finished. Returning normally is what a finished worker does.
    :func:`train` uses it; pass it to your own ``DataParallelTrainer`` (:func:`data_parallel_trainer`) beside
    :class:`PhalanxConfig`.

    Example:
        >>> training_function(max, 3, 5)()
        5
    """
    def run() -> Any:
        try:
            return fn(*args)
        except EndedBeforeAdmitted:
            return None  # training ended before this worker got in: nothing failed, nothing is left to do

    return run


def data_parallel_trainer(*args: Any, pg_cleaner: bool = True, **kwargs: Any) -> Any:
    """Ray Train's ``DataParallelTrainer(*args, **kwargs)``, less the helper actors a phalanx job does not use.

    Ray Train 2.60 starts a ``DatasetManager`` actor (a process importing Ray Data, ~2 CPU s) at every worker-group
    start and at every replacement of a lost worker, datasets or not: without ``datasets=`` it is left out (a
    replacement then competes with one process less on its way to the next commit). ``pg_cleaner=False`` also
    leaves out Ray Train's ``PlacementGroupCleaner`` (a detached process per run, which removes the workers'
    placement group if the controller dies; it polls Ray's state API, which a cluster without its dashboard does
    not serve): for a caller that removes it itself, as :func:`~phalanx.launch.raytrain.train` does. Use it for your
    own trainer with :class:`PhalanxConfig`.

    Example:
        >>> from ray.train import ScalingConfig  # doctest: +SKIP
        >>> t = data_parallel_trainer(training_function(print, "hi"), backend_config=PhalanxConfig(),
        ...                           scaling_config=ScalingConfig(num_workers=2))  # doctest: +SKIP
        >>> t.fit()  # doctest: +SKIP
    """
    from ray.train.v2.api.data_parallel_trainer import DataParallelTrainer

    try:  # Ray Train's private names: another Ray release may move them; then its trainer runs as it is
        from ray.train.v2._internal.callbacks.datasets import DatasetsCallback
        from ray.train.v2._internal.callbacks.placement_group_callback import PlacementGroupCleanerCallback
    except ImportError:
        return DataParallelTrainer(*args, **kwargs)
    if not hasattr(DataParallelTrainer, "_create_default_callbacks"):
        return DataParallelTrainer(*args, **kwargs)
    unused = (() if kwargs.get("datasets") else (DatasetsCallback,)) + (() if pg_cleaner
                                                                       else (PlacementGroupCleanerCallback,))

    class Trainer(DataParallelTrainer):  # type: ignore[misc,valid-type]
        def _create_default_callbacks(self) -> list:
            return [c for c in super()._create_default_callbacks() if not isinstance(c, unused)]

    return Trainer(*args, **kwargs)


def lost_state_error(what: str, checkpoint: str | None) -> JobLostError:
    """The one line that ends a job whose training state is gone, naming the newest checkpoint to resume from.

    Example:
        >>> print(lost_state_error("Ray Train's controller was lost", "/c/step-8"))  # doctest: +NORMALIZE_WHITESPACE
        phalanx: ray: Ray Train's controller was lost; the job ends. Newest checkpoint: /c/step-8 (resume:
        phalanx.raytrain.train(..., resume_from_checkpoint='/c/step-8'))
    """
    if checkpoint is None:
        where = ("No checkpoint was written (px.save_checkpoint): the commits were in memory only, so a new run "
                 "starts from the beginning")
    else:
        where = (f"Newest checkpoint: {checkpoint} (resume: phalanx.raytrain.train(..., "
                 f"resume_from_checkpoint={checkpoint!r}))")
    return JobLostError(f"phalanx: ray: {what}; the job ends. {where}", checkpoint)


def _where() -> tuple[int, int, int]:
    """On a worker: its Ray Train world rank (slot), local rank and local world size."""
    import ray.train

    ctx = ray.train.get_context()
    return ctx.get_world_rank(), ctx.get_local_rank(), ctx.get_local_world_size()


def _placement_group() -> str | None:
    """On a worker: the id (hex) of the placement group Ray Train placed it in."""
    import ray

    pg = ray.util.get_current_placement_group()
    return pg.id.hex() if pg is not None else None


def _enter(env: dict[str, str]) -> None:
    """On a worker, before the training function starts: the environment ``px.init()`` reads."""
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "PHALANX_ELASTIC_JOIN"):
        os.environ.pop(name, None)
    os.environ.update(env)


class _PhalanxBackend(Backend):  # type: ignore[misc]
    """Starts phalanx's elastic group on the workers Ray Train placed; Ray Train calls it from its controller."""

    # Ray Train 2.60: each worker is a replica group of one, so a lost worker is replaced alone
    # (ray.train.v2 controller: `_replace_bad_workers`) and the others keep running.
    has_replica_groups = True
    PROBE_S = 30.0  # the bound on asking a replica group whether its workers are alive, at a replacement

    def __init__(self) -> None:
        self.job: _Job | None = None
        self.whole: Any = None  # Ray Train's whole worker group (the first start), to see its other replica groups
        self._retiring = False

    def on_start(self, worker_group: Any, backend_config: PhalanxConfig) -> None:
        cfg = backend_config
        joining = self.job is not None  # the first start hosts the job; later ones are Ray's replacements
        if self.job is None:
            self.job = _Job(cfg)
            self.whole = worker_group
            # the workers' placement group, for the driver to release if this controller is lost (Ray Train's
            # own cleaner asks the state API, which a cluster without its dashboard does not serve)
            group_id = worker_group.execute_single(0, _placement_group)
            if group_id is not None:
                self.job.store.set(key("ray", "placement_group"), group_id)
        elif (lost := self.job.state_lost()) is not None:
            # a replacement with nobody to enter from would wait forever: end the job (Ray Train's controller
            # error, never retried), with the newest checkpoint named
            self.job.ended = lost
            print(str(lost), file=sys.stderr, flush=True)
            raise lost
        places = worker_group.execute(_where)
        for i, (slot, local_rank, local_world) in enumerate(places):
            wid = self.job.replace(slot) if joining else self.job.ids[slot]
            env = self.job.env(slot, joining or slot >= cfg.num_workers, local_rank, local_world, cfg.num_workers)
            worker_group.execute_single(i, _enter, env)
            self.job.actors[wid] = worker_group.get_workers()[i].actor

    def on_shutdown(self, worker_group: Any, backend_config: PhalanxConfig) -> None:
        if self.job is None:
            return
        workers = worker_group.get_workers()
        if len(workers) < backend_config.total_workers and self.job.ended is not None:
            return  # the job is over (its state was lost): Ray shuts the rest down next
        if len(workers) < backend_config.total_workers:  # a failed replica group: Ray replaces it next
            for w in workers:
                self.job.lost(w.distributed_context.world_rank, "was lost (its Ray actor failed)")
            self._retire_other_failures(worker_group)
            return
        self.job.close()  # the whole group ends: training finished, or Ray Train gave up or restarts it all
        self.job = self.whole = None

    def _retire_other_failures(self, replacing: Any) -> None:
        """Shut down every other replica group that failed in the same poll, before Ray replaces ``replacing``.

        Ray Train 2.60 replaces failed replica groups one at a time, and each replacement first
        clears the result queue of every replica group still active, the other failed ones
        included: a dead actor's call raises, the controller takes that for its own error
        (``ControllerError``, never retried) and the job ends although the survivors hold
        ``min_workers``. A replica group already shut down is skipped there, and Ray replaces it
        next all the same (its shutdown is a no-op then), so two losses at the same moment are two
        replacements, as two losses apart are. A worker that died after that poll is found by the
        same call Ray is about to make (``clear_result_queue``, which Ray repeats right after): its
        group is shut down too, and Ray's next poll sees it failed and replaces it.
        """
        import ray

        if self.whole is None or self._retiring:
            return  # a group shut down here calls on_shutdown again: one sweep at a time
        self._retiring = True
        try:
            polled = self.whole.get_latest_poll_status()
            groups = self.whole.get_replica_groups() or []
            failing = polled.failing_replica_group_indices if polled is not None else set()
            others = [g for g in groups if g is not replacing and g.is_active()]
            calls = {id(g): [w.actor.clear_result_queue.remote() for w in g.get_workers()]
                     for i, g in enumerate(groups) if g in others and i not in failing}
            for i, g in enumerate(groups):
                if g not in others:
                    continue
                if i not in failing:
                    try:
                        ray.get(calls[id(g)], timeout=self.PROBE_S)
                        continue  # alive: Ray's own call will answer too
                    except ray.exceptions.RayActorError:
                        pass  # died after the poll
                    except Exception:  # noqa: BLE001 - slow or odd, not known dead: left to Ray's own call
                        continue
                g.shutdown()
        finally:
            self._retiring = False
