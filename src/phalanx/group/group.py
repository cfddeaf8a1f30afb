"""The worker group: the one place that reads the environment.

A script launched by ``phalanx run`` or ``torchrun`` sees ``RANK``, ``LOCAL_RANK``,
``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT``. A plain ``python script.py``
sees none of them and is a group of one, which needs no process group at all.

Everything about the group lives on one object, :class:`Group`, which ``px.init()``
returns; the module functions (``px.rank()``, ``px.world_size()`` ...) read the
current one. The current group is the only module-level state.

Example:
    >>> import phalanx as px
    >>> g = px.init()
    >>> px.rank(), px.world_size(), g is px.current_group()
    (0, 1, True)
"""
from __future__ import annotations

import atexit
import json
import os
import time
import traceback
import weakref
from dataclasses import replace
from datetime import timedelta
from typing import TYPE_CHECKING, Callable, Sequence

import torch
import torch.distributed as dist

from . import forming, leaving, liveness, orphan, stacks
from .records import Records

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh  # torch's, imported on first use only (1.1 s)
from ..errors import ConfigError, PhalanxError, WorkerLostError, usage
from .env import WorkerEnv

class Group:
    """The worker group this process belongs to: the one owner of who is in the run now.

    ``px.init()`` returns it; ``px.current_group()`` returns it later. It holds this
    worker's rank, the world size, its device, the group's store, the bound on every
    collective and the **generation**: 0 at start, bumped by every :meth:`rebuild`
    (``phalanx.elastic`` rebuilds the group when a worker is lost or joins). One
    heartbeat per worker tells peers it is alive; :meth:`lost_peers` names the ranks
    known to be gone; :meth:`on_regroup` callbacks run after each rebuild.

    The object stays the same across rebuilds: hold it and read ``rank`` and
    ``world_size`` when you need them.

    Example:
        >>> import phalanx as px
        >>> g = px.init(); (g.rank, g.world_size, g.generation, g.elastic)
        (0, 1, 0, False)
        >>> g.lost_peers()
        []
    """

    def __init__(self, env: WorkerEnv, device: torch.device, *, store: dist.Store | None = None,
                 job_store: dist.Store | None = None, backend: str | None = None) -> None:
        self.env, self.device, self.backend = env, device, backend
        self.store: dist.Store | None = None  # this generation's key space
        self.probe: dist.Store | None = None  # a second connection with a short timeout, for diagnosis and exit notes
        # The store that outlives every generation (the launcher's, under `phalanx run`/torchrun): features keep
        # job-wide keys there, under job_key().
        self.job_store = job_store
        self.heartbeat: liveness.Heartbeat | None = None
        self.generation = 0
        self.elastic = env.elastic_id is not None  # `phalanx run --elastic` / `phalanx join`: the group may change
        self.failed: BaseException | None = None  # the exception this worker is exiting with, if any
        self.uncaught: BaseException | None = None  # ...when the interpreter exits because nobody caught it
        self.losses: list[int] = []  # the ranks this worker's last WorkerLostError blamed
        # A joiner of an elastic job between its admission (:meth:`place`) and its entry into training: rank,
        # world size and generation are its place in the group, but its process group forms only when it enters
        # (phalanx.elastic takes rank 0's state then). Until that, collectives have nobody to talk to.
        self.entering = False
        self.leaves_at_exit = False  # px.shutdown() is registered to run at exit (once the group has a store)
        self._on_regroup: list[Callable[["Group"], None]] = []
        # What other packages keep for this group (the step clocks, the preemption handler, the checkpoint being
        # written, the timeline), each a typed record its own package declares: the group holds membership.
        self.records = Records()
        self._meshes: dict[int, DeviceMesh] = {}  # shard size -> this generation's mesh (phalanx.sharding.layout)
        # This generation's torch process group (torch's default group too), and the subgroups split from it.
        # Both go with the generation: rebuild() destroys them before it forms the next one.
        self.process_group: dist.ProcessGroup | None = None
        self._splits: dict[tuple[str, tuple[tuple[int, ...], ...]], dist.ProcessGroup] = {}
        # Who of this generation is known lost beyond its exit notes: the ``lost`` that rebuild() was given (the
        # elastic layer's dead marks, set by the launcher the moment a worker dies). split() forms this
        # generation's subgroups watching it too.
        self._lost: Callable[[], Sequence[int]] | None = None
        if store is not None:
            self._attach_store(store)

    # -- who and where --------------------------------------------------------------------------------------
    @property
    def rank(self) -> int:
        """This worker's rank in the current generation."""
        return self.env.rank

    @property
    def world_size(self) -> int:
        """Workers in the current generation."""
        return self.env.world_size

    @property
    def local_rank(self) -> int:
        """Rank within this host; picks the GPU."""
        return self.env.local_rank

    @property
    def timeout_s(self) -> float:
        """The bound on every collective and store wait, in seconds."""
        return self.env.timeout_s

    def lost_peers(self) -> list[int]:
        """Ranks of this generation known to be gone now: they left a failure note in the group's store.

        Cheap and non-blocking (one store round trip per rank, no waiting for heartbeats to go
        stale): a worker waiting outside a collective (on a parameter server) asks it now and
        then. A rank that ended normally is not counted. Empty in a group of one, or when the
        store does not answer.
        """
        if self.probe is None:
            return []
        try:
            notes = liveness.exit_records(self.probe, self.world_size)
        except Exception:  # the store's host is gone: nobody can tell
            return []
        return sorted(r for r, why in notes.items() if r != self.rank and not why.startswith("ok"))

    @property
    def owns_groups(self) -> bool:
        """True when this group forms its process groups itself (:mod:`phalanx.group.forming`), on keys that name
        the generation: a group rebuilt while the job runs (``phalanx run --elastic``), over gloo.

        Elsewhere torch's ``init_process_group`` forms the one group of the run, as under plain torchrun:
        a group formed once, whose failure ends the run, never meets torch's per-process naming again.
        """
        return self.elastic and (self.backend or "gloo") == "gloo"

    def mesh(self, shard_size: int) -> DeviceMesh:
        """The 2-D ``DeviceMesh`` of this generation: dims ("replicate", "shard"), R = world_size // shard_size.

        Rank ``r * shard_size + s`` is shard ``s`` of replica group ``r``. Built once per generation
        from this generation's own subgroups (:meth:`split`; collective the first time: every rank
        must ask for the same sizes in the same order) and dropped by :meth:`rebuild`.
        """
        if shard_size < 1 or self.world_size % shard_size:
            raise ConfigError(usage(f"a mesh of shards of {shard_size} over {self.world_size} workers",
                                    "a shard size that divides the world size",
                                    f"Pick a divisor of {self.world_size}."))
        if shard_size not in self._meshes:
            from torch.distributed.device_mesh import DeviceMesh  # torch's, imported on first use only (1.1 s)
            replicas = self.world_size // shard_size
            layout = torch.arange(self.world_size).view(replicas, shard_size)
            replicate = self.split([layout[:, s].tolist() for s in range(shard_size)], f"mesh{shard_size}/replicate")
            shard = self.split([layout[r].tolist() for r in range(replicas)], f"mesh{shard_size}/shard")
            self._meshes[shard_size] = DeviceMesh.from_group([replicate, shard], self.device.type, mesh=layout,
                                                             mesh_dim_names=("replicate", "shard"))
        return self._meshes[shard_size]

    def split(self, parts: Sequence[Sequence[int]], tag: str, backend: str | None = None,
              timeout_s: float | None = None) -> dist.ProcessGroup | None:
        """This rank's process group among ``parts`` (lists of ranks that cover the group), made once per generation.

        Collective: every rank calls it with the same ``parts`` and ``tag`` (a name for this
        split, e.g. "checkpoint"). A group that :attr:`owns_groups` forms each part on keys
        of its own (``<generation>/split/<tag>/<i>``), bounded and watching for lost peers like
        the generation itself; otherwise torch's ``new_group`` makes every part, with ``backend``
        (default: the group's). ``timeout_s`` bounds each collective on the part (default: the
        group's bound, :attr:`timeout_s`, on groups it owns; torch's default on torch's). Where
        the group owns its groups, a failure to form is a :class:`~phalanx.errors.WorkerLostError`.

        Example:
            >>> import phalanx as px
            >>> px.current_group().split([[0]], "example") is None   # a group of one has no process group
            True
        """
        key = (tag, tuple(tuple(int(r) for r in part) for part in parts))
        if key in self._splits:
            return self._splits[key]
        if self.process_group is None:
            return None
        mine = next(i for i, part in enumerate(key[1]) if self.rank in part)
        if self.owns_groups:
            part = key[1][mine]
            store = dist.PrefixStore(f"split/{tag}/{mine}", self.store)
            # a member SIGKILLed while the subgroups form leaves no exit note: its dead mark (lost) is what tells
            backend_ = forming.form(store, part.index(self.rank), len(part), self.timeout_s,
                                    lambda: self._lost_now(self.store, self.world_size, self._lost), timeout_s)
            pg = forming.register_subgroup(backend_, part)
        else:  # torch's new_group: every rank makes every part, in the same order
            bound = None if timeout_s is None else timedelta(seconds=timeout_s)  # None: torch's default, as before
            groups = [dist.new_group(list(part), backend=backend, timeout=bound) for part in key[1]]
            pg = groups[mine]
        self._splits[key] = pg
        return pg

    # -- membership changes ---------------------------------------------------------------------------------
    def on_regroup(self, callback: Callable[["Group"], None]) -> Callable[[], None]:
        """Call ``callback(group)`` after every :meth:`rebuild`, with the new rank and size; returns an unsubscribe.

        Example:
            >>> import phalanx as px
            >>> seen = []; stop = px.current_group().on_regroup(lambda g: seen.append(g.world_size)); stop()
        """
        self._on_regroup.append(callback)
        return lambda: self._on_regroup.remove(callback) if callback in self._on_regroup else None

    def place(self, rank: int, world_size: int, generation: int) -> None:
        """A joiner's place in a group it has not entered yet: ``rank`` of ``world_size`` in ``generation``.

        ``phalanx.elastic`` calls it from ``px.init()`` once the members admitted this worker, so
        the script reads the rank and world size it will train with from the start (as torchrun's
        workers read ``RANK``/``WORLD_SIZE``). :attr:`entering` stays True, and collectives act as
        in a group of one, until :meth:`rebuild` forms the process group at that generation.
        """
        self.env = replace(self.env, rank=rank, world_size=world_size)
        self.generation, self.entering = int(generation), True

    def rebuild(self, rank: int, world_size: int, store: dist.Store, *, generation: int | None = None,
                job_store: dist.Store | None = None, backend: str | None = None,
                lost: Callable[[], Sequence[int]] | None = None) -> None:
        """Leave the current process group and form the next generation's: ``rank`` of ``world_size`` on ``store``.

        Collective across the new members. ``generation`` is the number the members agreed
        on (default: the next one); it must grow. gloo's group cannot shrink, so the old one is
        destroyed first: a peer blocked on our sockets then fails at once instead of at its
        timeout. The new one is formed on ``store`` alone (:mod:`phalanx.group.forming`): its
        waits end at the bound of every collective or as soon as a member is known lost (an exit
        note in ``store``, or a rank that ``lost()`` names). A failure to form raises
        :class:`~phalanx.errors.WorkerLostError` and leaves this group as it was, without a process
        group: the caller regroups once more. Once formed, the heartbeat and the probe connection
        move to ``store`` under the new rank, then the :meth:`on_regroup` callbacks run.
        """
        generation = self.generation + 1 if generation is None else int(generation)
        if generation < self.generation or (generation == self.generation and not self.entering):
            raise ConfigError(usage(f"rebuild to generation {generation}", f"a generation after {self.generation}",
                                    "Pass the next generation number the members agreed on."))
        self.drop_process_groups()
        self.backend = backend or self.backend or ("nccl" if self.device.type == "cuda" else "gloo")
        self._form(rank, world_size, store, lost)
        self._lost = lost
        self.generation, self.entering = generation, False
        self.env = replace(self.env, rank=rank, world_size=world_size)
        self.job_store = job_store if job_store is not None else self.job_store
        self.losses = []
        self._attach_store(store)
        if self is _group:
            leaving.leave_at_exit(self, shutdown)
        for callback in list(self._on_regroup):
            callback(self)

    def drop_process_groups(self) -> None:
        """Destroy this generation's process groups, and drop this group's references to them first.

        gloo closes a group's sockets only when the group object is freed: a reference kept here
        would leave a peer blocked on us waiting for its collective timeout instead of failing at once.

        Example:
            >>> import phalanx as px
            >>> px.current_group().drop_process_groups()   # a group of one has none: nothing happens
        """
        subgroups = [weakref.ref(pg) for pg in self._splits.values()]  # weak: a reference here would keep them
        self._meshes, self._splits, self.process_group = {}, {}, None
        leaving.destroy_process_group(also=subgroups)

    def _form(self, rank: int, world_size: int, store: dist.Store,
              lost: Callable[[], Sequence[int]] | None = None) -> None:
        """Form this generation's process group on ``store`` and make it torch's default group (collective)."""
        if self.owns_groups:
            backend = forming.form(store, rank, world_size, self.timeout_s,
                                   lambda: self._lost_now(store, world_size, lost, rank))
            self.process_group = forming.install(backend, store, rank, world_size, self.timeout_s)
        else:
            dist.init_process_group(self.backend, store=store, rank=rank, world_size=world_size,
                                    timeout=timedelta(seconds=self.timeout_s))
            self.process_group = dist.group.WORLD

    def _lost_now(self, store: dist.Store, world_size: int, lost: Callable[[], Sequence[int]] | None,
                  me: int | None = None) -> list[int]:
        """Ranks of the generation in ``store`` known gone now: an exit note there (left by the rank or by the
        watcher that saw it exit), or named by ``lost()`` (the elastic layer's dead marks)."""
        me = self.rank if me is None else me
        gone = {r for r in liveness.exit_records(store, world_size) if r != me}
        return sorted(gone | set(lost() if lost is not None else ()))

    def _attach_store(self, store: dist.Store) -> None:
        """Beat and probe on ``store`` (the first one, or the next generation's) under the current rank."""
        if self.heartbeat is not None:
            self.heartbeat.stop()
        self.store = store
        self.heartbeat = liveness.Heartbeat(store, self.rank).start()
        self.probe = liveness.second_connection(store)

    # -- failure ----------------------------------------------------------------------------------------------
    def fail(self, exc: BaseException) -> None:
        """This worker is ending with ``exc``: tell peers (store) and the launcher (error file), once."""
        if self.failed is not None:
            return
        self.failed = exc
        if self.heartbeat is not None:
            self.heartbeat.stop()
        if self.probe is not None:
            try:
                liveness.record_exit(self.probe, self.rank, leaving.reason(exc))
            except Exception:
                pass  # the store's host is gone; the launcher or a stale heartbeat will tell
        path = self.env.error_file
        if path:
            # torch.distributed.elastic's error-file format, read by torchrun and `phalanx run`;
            # "phalanx" carries what our launcher needs for its one line.
            data = {"message": leaving.reason(exc), "timestamp": int(time.time()),
                    "phalanx": {"rank": self.rank, "type": type(exc).__name__, "time": time.time(),
                                "text": " ".join(str(exc).split())[:2000],
                                # WorkerLostError reports another rank's failure, not a cause of its own
                                "usage": isinstance(exc, PhalanxError) and not isinstance(exc, WorkerLostError),
                                "consequence": isinstance(exc, WorkerLostError),
                                "traceback": "".join(traceback.format_exception(exc))[-20000:]}}
            try:  # whole or absent: the launcher may read it the moment this worker's sibling exits
                tmp = f"{path}.tmp-{os.getpid()}"
                with open(tmp, "w") as f:
                    json.dump(data, f)
                os.replace(tmp, path)
            except OSError:
                pass

    def __repr__(self) -> str:
        return (f"Group(rank={self.rank}, world_size={self.world_size}, generation={self.generation}, "
                f"device={self.device}, elastic={self.elastic}{', entering' if self.entering else ''})")


_group: Group | None = None  # the current group: the one piece of module state


def job_key(*parts: object) -> str:
    """A key in the job's store (:attr:`Group.job_store`) that every generation and the launcher agree on.

    Example:
        >>> job_key("ps", "restarts")
        'phalanx/job/ps/restarts'
    """
    return "/".join(["phalanx/job", *map(str, parts)])


def init(backend: str | None = None, timeout: float | None = None, threads: int | None = None,
         place: Callable[[Group], None] | None = None) -> Group:
    """Join the worker group described by the environment and return it; idempotent.

    ``backend`` defaults to NCCL when CUDA is available and gloo otherwise.
    ``timeout`` bounds every collective (seconds), so a lost peer fails fast.
    ``place`` takes this worker's place in a job whose membership can change (``px.init()`` passes the elastic
    feature's); a worker of such a job started without it is refused, so that no core path (a Trainer, a
    preemption handler) that joins the group on the user's behalf trains alone beside the job.

    Example:
        >>> import phalanx as px; px.init().world_size
        1
    """
    global _group
    if _group is not None:
        return _group
    env = WorkerEnv.from_environ()
    if env.elastic_id is not None and place is None:
        raise _unplaced()
    if timeout is not None:
        if not float(timeout) > 0:
            raise ConfigError(usage(f"timeout={timeout}", "a positive number of seconds", "Pass e.g. timeout=60."))
        env = replace(env, timeout_s=float(timeout))
    if threads is not None:
        if int(threads) < 1:
            raise ConfigError(usage(f"threads={threads}", "an integer >= 1", "Pass e.g. threads=1."))
        env = replace(env, threads=int(threads))
    timeout_s = env.timeout_s
    if env.threads is not None:
        torch.set_num_threads(env.threads)
    use_cuda = torch.cuda.is_available()
    if use_cuda and (backend or "nccl") == "nccl" and env.local_world_size > torch.cuda.device_count():
        # NCCL refuses two ranks on one GPU, but only inside the first collective, as an "invalid usage"
        # that reads like a lost peer: say what is wrong before anything starts.
        raise ConfigError(usage(f"{env.local_world_size} workers on this host on NCCL, with "
                                f"{torch.cuda.device_count()} GPU(s) visible",
                                "at most one NCCL worker per GPU",
                                f"Start at most {torch.cuda.device_count()} worker(s) per host (-n), or let workers "
                                "share a GPU over gloo: px.init(backend='gloo')."))
    device = torch.device("cuda", env.local_rank % torch.cuda.device_count()) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    backend = backend or ("nccl" if use_cuda else "gloo")
    g = Group(env, device, backend=backend)
    # Under a phalanx launcher, its end ends this worker (not the store's: group/orphan.py says why).
    orphan.watch_launcher(env.launcher_pid, f"worker {env.elastic_id}" if env.elastic_id else f"worker rank {env.rank}")
    # Answers `phalanx stacks` and the launcher's watchdog; stopped after shutdown's leaving (atexit runs last first).
    # (a joiner has no rank until it is admitted: -1 till then)
    responder = stacks.respond(env, lambda: (-1 if g.env.elastic_join and g.store is None and not g.entering
                                             else g.rank, g.generation), stacks.PROGRESS.of(g))
    if responder is not None:
        stacks.RESPONDER.of(g).value = responder
        atexit.register(responder.stop)
    if env.world_size > 1 and not dist.is_initialized():
        # We own the store so that failure diagnosis (which rank is gone?) has a side channel
        # that does not depend on the broken process group.
        job = dist.TCPStore(env.master_addr, env.master_port, env.world_size,
                            is_master=env.rank == 0 and not env.agent_store,
                            timeout=timedelta(seconds=timeout_s), wait_for_workers=False)
        g.job_store = job
        # Beat before joining: once the process group exists, every rank is visibly alive.
        g._attach_store(dist.PrefixStore(f"phalanx/{env.attempt}", job))
        g._form(env.rank, env.world_size, g.store)
    elif dist.is_initialized():  # the script formed torch's default group itself before px.init()
        g.process_group = dist.group.WORLD
    _group = g
    if g.store is not None:
        leaving.leave_at_exit(g, shutdown)
    if place is not None:
        place(g)
    return g


def _unplaced() -> ConfigError:
    # A worker of `phalanx run --elastic` takes its place in px.init() (a joiner waits there to be admitted);
    # without it this process would train alone as a group of one, beside the job it was started for.
    return ConfigError(usage("a phalanx call in a `phalanx run --elastic` worker before px.init()",
                             "px.init() first: it takes this worker's place in the elastic job",
                             "Call px.init() at the top of the script."))


def shutdown() -> None:
    """Leave the group; runs at interpreter exit too, and is safe to call twice.

    On a normal exit workers meet at a short barrier first: destroying a gloo group
    while a peer is still tearing its own down aborts the process now and then
    ("terminate called without an active exception", seen in about 1 run in 6 on 2
    workers here, plain torch too). They meet in the store before the barrier, so a
    peer that failed or died is noticed within seconds (its exit note or its silent
    heartbeat) and nobody waits for the collective timeout.

    A worker leaving with an exception (called from a ``finally`` or at exit after an
    uncaught error) skips the barrier and leaves the group as it is: its peers learn of
    the failure from its exit note, and the process ends at once.

    When this worker hosts the store (rank 0 launched without torchrun or ``phalanx
    run``) and something failed, it waits (a few seconds at most) for every peer to
    leave a note or fall silent, so their diagnosis can still read the store.
    The steps are :mod:`phalanx.group.leaving`'s.

    Example:
        >>> import phalanx as px
        >>> _ = px.init(); px.shutdown(); px.is_initialized()
        False
    """
    global _group
    g, met = _group, True
    if g is not None:
        leaving.finish_background_work(g)
    if g is not None and g.store is not None:
        exc = leaving.failure(g)
        if exc is not None:
            _group = None
            leaving.leave_failed(g, exc)
            return  # no barrier: a failed worker's teardown must not wait on anyone
        met = leaving.leave_normally(g)
    if g is not None:
        g.drop_process_groups()  # the group object may outlive this (a script holds it): it keeps no process group
    elif dist.is_initialized():
        dist.destroy_process_group()
    if g is not None and g.store is not None and not met and leaving.hosts_store(g):
        leaving.linger_for_peers(g)
    if g is not None and stacks.RESPONDER.of(g).value is not None:
        stacks.RESPONDER.of(g).value.stop()  # a later px.init() starts its own
    _group = None


def current() -> Group:
    """The current group (``px.current_group()``): the one ``px.init()`` returned, or a group of one.

    Refuses a multi-worker run that skipped ``px.init()``.

    Example:
        >>> import phalanx as px
        >>> px.current_group().world_size
        1
    """
    if _group is not None:
        return _group
    env = WorkerEnv.from_environ()
    if env.world_size > 1:
        raise ConfigError(usage(f"a phalanx call in a {env.world_size}-worker run before px.init()",
                                "px.init() first", "Call px.init() at the top of the script."))
    if env.elastic_id is not None:
        raise _unplaced()
    return Group(env, torch.device("cuda" if torch.cuda.is_available() else "cpu"))


def is_initialized() -> bool:
    """True once px.init() has run in this process."""
    return _group is not None


def rank() -> int:
    """This worker's global rank (0 in a plain process)."""
    return current().rank


def world_size() -> int:
    """Number of workers in the group (1 in a plain process)."""
    return current().world_size


def local_rank() -> int:
    """Rank within this host; picks the GPU."""
    return current().local_rank


def is_main() -> bool:
    """True on rank 0, the worker that prints and saves."""
    return rank() == 0


def device() -> torch.device:
    """The device this worker computes on: its own GPU, or the CPU."""
    return current().device


def timeout_s() -> float:
    """The bound on every collective, in seconds."""
    return current().timeout_s


def store() -> dist.Store | None:
    """The group's key-value store (None in a group of one)."""
    return current().store


def probe_store() -> dist.Store | None:
    """A connection to the group's store with a short timeout, for liveness checks (None in a group of one)."""
    return current().probe
