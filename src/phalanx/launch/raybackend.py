"""The Ray Train backend of :func:`phalanx.launch.raytrain.train`: what each worker runs, and when Ray Train's
controller starts the job it hosts (:class:`~phalanx.launch.rayjob.ControllerJob`: store, secret, heartbeat watcher,
growing).

The Ray Train backend here (:class:`PhalanxConfig`) is Ray Train's own extension point for
a distributed backend. It declares its workers *replica groups* of one
(``Backend.has_replica_groups``, Ray 2.60): when a worker dies, Ray Train's controller
replaces that one worker in its placement-group slot and leaves the others running,
instead of restarting the whole group from a checkpoint. phalanx does the rest with the
machinery of ``phalanx run --elastic``: the survivors keep their processes and state,
rebuild the group without the lost worker and roll back to the newest in-memory commit
they all hold; the replacement enters at the next commit with rank 0's state.

The job's store, its secret and its watchers live in Ray Train's controller
(:mod:`phalanx.launch.rayjob`), never on a worker.

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

import os
import sys
from dataclasses import dataclass, field
from typing import Any, Callable

from ..elastic.membership import key
from ..elastic.admission import EndedBeforeAdmitted
from ..errors import ConfigError, usage
from .elastic import quiet_store_env
from .rayjob import ControllerJob

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
        self.job: ControllerJob | None = None
        self.whole: Any = None  # Ray Train's whole worker group (the first start), to see its other replica groups
        self._retiring = False

    def on_start(self, worker_group: Any, backend_config: PhalanxConfig) -> None:
        cfg = backend_config
        joining = self.job is not None  # the first start hosts the job; later ones are Ray's replacements
        if self.job is None:
            self.job = ControllerJob(cfg)
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
