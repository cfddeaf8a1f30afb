"""The elastic job Ray Train's controller hosts for :mod:`phalanx.launch.raybackend`: the store and secret, the
heartbeat watcher, the replacements' and the grown workers' bookkeeping, and the one line that ends a job whose
state is gone.

The job's store (and its secret) live in Ray Train's controller actor, which Ray pins to
the node of the driver (``trainer.fit()``'s caller), not on any worker: a lost worker,
rank 0 included, never takes it along. The controller writes what Ray's fault detection
sees into it (``elastic/dead/<id>`` when a worker's actor died), as the launcher of
``phalanx run --elastic`` does for its processes. Its heartbeat watcher also asks Ray about a
worker whose heartbeat stood still 1.5 s, and marks a dead actor at once: Ray Train's controller
sees a loss only between its own steps, and starting a replacement (tens of seconds on a busy
machine) is one of them, so a second loss during a replacement would otherwise reach the
survivors' quorum too late.

Example:
    >>> print(lost_state_error("Ray Train's controller was lost", None))  # doctest: +NORMALIZE_WHITESPACE
    phalanx: ray: Ray Train's controller was lost; the job ends. No checkpoint was written (px.save_checkpoint): the
    commits were in memory only, so a new run starts from the beginning
"""
from __future__ import annotations

import json
import sys
import threading
import time
from typing import TYPE_CHECKING, Any, Callable

from ..elastic import secret
from ..elastic.membership import key
from ..elastic.watch import mark_dead
from ..errors import JobLostError
from .elastic import _members, generation_members, listening_store, saved_checkpoint
from .stacks import Watchdog
from .status import JobStatus, stacks_button

if TYPE_CHECKING:
    from .raybackend import PhalanxConfig


class ControllerJob:
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
        runner = ray.remote(Grown)
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


class Grown:
    """A worker started outside Ray Train's worker group when the cluster gained room (a Ray actor)."""

    def run(self, fn: Callable[[], Any]) -> Any:
        return fn()


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
