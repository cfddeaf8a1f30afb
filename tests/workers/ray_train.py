"""The training function the Ray tests run on Ray Train workers (``phalanx.launch.raytrain.train(main, ...)``).

It is tests/workers/elastic.py's loop as a function: each worker records, per step, the
sample ids the whole group trained on (rolled back with the commits) and writes its id,
pid, final parameters and that record to ``out``. ``kill="1@5"``: the worker started as
rank 1 writes ``victim.json`` (its pid) before step 5 and parks there; the test kills its
actor process with SIGKILL (``stop=True``: it stops itself with SIGSTOP, and the heartbeat
watcher in Ray's controller kills it). ``kill="1,2@5"``: ranks 1 and 2 both park before step 5
(``victim1.json``, ``victim2.json``), for a test that kills them at the same moment.
``late=True``: a replacement Ray starts waits, before ``px.init()``, until every survivor has
written its result (training has ended), so that it arrives after the end. ``slow_below=3``:
while fewer than 3 workers train, each step waits until Ray's replacement has asked to join,
so it enters before training ends. ``kill="1@4;0,2@8"``: a second group of victims parks before step 8 after the
first regroup (each group once, after as many regroups as groups before it). ``regroup_victim="0"``: every worker
entering its first regroup waits for ``controller-held`` (see :class:`HeldConfig`), and that one parks there
(``victim-regroup.json``); with ``regroup_armed=NAME`` it is instead the first regroup each worker enters once
``out/NAME`` exists (a later loss of a run that already regrouped). ``kill="1@4;2,r1@8/3"``: a group with ``/W``
parks at the first step from 8 on at which the group has had W workers for a whole commit interval (all of them at
the same step: they train in step; the commit at the end of it keeps steps at W workers through the rollback), so a
later phase can follow the replacements' joins, whenever they came. ``slow_for``: how long after the
start ``slow_below`` waits for joiners at all (a run with several phases needs longer than one);
``slow_first=True``: it waits only until the group first changed (a later replacement may be one held back).
``checkpoint=DIR``: ``px.save_checkpoint`` to
``DIR/step-<n>`` after every ``save_every``-th commit (the record in its ``extra``; rank 0 then writes
``saved-<n>``), and a run given ``resume_from_checkpoint`` starts from ``px.resume_from()``. ``hold_replacements``:
a replacement waits before ``px.init()`` for ``DIR/release-replacements``. Every step appends
``{"id", "step", "t"}`` to ``steps.jsonl``.

:class:`HeldConfig` is :class:`~phalanx.launch.raybackend.PhalanxConfig` whose backend holds Ray Train's controller
inside every replacement's start (as a slow start on a loaded machine does) until ``DIR/release-controller``:
Ray Train's own view of the workers stands still meanwhile.
"""
from __future__ import annotations

import glob
import json
import os
import signal
import time

from dataclasses import dataclass

import torch.nn.functional as F

import phalanx as px
from phalanx.launch.raybackend import PhalanxConfig, _PhalanxBackend
from workers.elastic import BATCH, setup
from support.loop import elastic_id, epoch_batches, group_ids, take_step, write_worker
from support.wait import until


def wait_for_joiner(state: px.elastic.State, deadline: float) -> None:
    """Block until a worker Ray started can be let in by the next commit point, or the deadline.

    A joiner enters in two stages, each at a commit point: one offers it a place (``offer/<id>``; its
    ``px.init()`` waits for that), a later one admits it once it is ready (``ready/<id>``: it started up and waits
    at the start of training). So this returns as soon as a joiner asked and has no offer yet (waiting here would
    hold back the very commit point that offers it one: nobody moves until the deadline), and otherwise once an
    offered joiner is ready: asking is not enough, its start-up may outlast training.
    """
    from phalanx.elastic.membership import key

    store, members = state.worker.store, set(state.worker.membership.members)
    # a joiner that entered earlier and was lost since is no joiner to wait for (its offer and ready keys stay)
    entered = {w for h in state.history for w in h["joined"] + h["left"]}

    def next_commit_lets_one_in() -> bool:
        asked = set(json.loads(store.get(key("joiners")))) - members - entered if store.check([key("joiners")]) \
            else set()
        return any(not store.check([key("offer", j)]) or store.check([key("ready", j)]) for j in asked)

    try:
        until(next_commit_lets_one_in, timeout=max(0.0, deadline - time.monotonic()),
              what="a joiner to offer a place to, or one ready to enter")
    except AssertionError:
        return  # none by the deadline: the caller goes on without it


def wait_for_the_end(out: str, victims: list[str], timeout: float) -> None:
    """A replacement held back until every worker that was not killed has written its result."""
    def ended() -> bool:
        starts = {os.path.basename(p).removeprefix("start").split("-")[0]
                  for p in glob.glob(os.path.join(out, "start*"))}
        survivors = {s for s in starts if s.isdigit() and s not in victims}
        return bool(survivors) and all(os.path.exists(os.path.join(out, f"worker{s}.json")) for s in survivors)

    until(ended, timeout=timeout, what="the survivors' results")


def park(out: str, name: str, me: str, stop: bool = False) -> None:
    """Write ``out/name`` (this process's pid, whole or absent) and wait there to be killed (kill -9)."""
    with open(os.path.join(out, f"{name}.tmp"), "w") as f:
        json.dump({"id": me, "pid": os.getpid(), "time": time.time()}, f)
    os.replace(os.path.join(out, f"{name}.tmp"), os.path.join(out, name))
    if stop:  # hung: only the heartbeat watcher in Ray's controller can free the others
        os.kill(os.getpid(), signal.SIGSTOP)
    while True:  # parked until the test kills this process
        signal.pause()


def main(out: str, kill: str = "", epochs: int = 2, commit_every: int = 2, slow_below: int = 0,
         stop: bool = False, late: bool = False, *, regroup_victim: str = "", checkpoint: str = "",
         save_every: int = 1, hold_replacements: bool = False, regroup_armed: str = "",
         slow_for: float = 120.0, slow_first: bool = False) -> dict:
    me = elastic_id()
    groups = [(spec.split(","), int(at.partition("/")[0]), int(at.partition("/")[2] or -1))
              for spec, _, at in (k.partition("@") for k in kill.split(";") if k)]
    victims = groups[0][0] if groups else []
    open(os.path.join(out, f"start{me}-{os.getpid()}"), "w").close()  # a restarted worker would leave a second one
    if late and me.startswith("r"):
        wait_for_the_end(out, victims, timeout=300)
        open(os.path.join(out, f"late-{me}"), "w").close()  # it reached px.init() after the others had finished
    if hold_replacements and me.startswith("r"):
        until(lambda: os.path.exists(os.path.join(out, "release-replacements")), timeout=300,
              what=f"replacement {me}: the test's release")
    px.init()
    model_, opt, loader, record, state = setup(commit_every, strategy=px.AllReduce())
    if px.resume_from() is not None and not me.startswith("r"):  # a new run from a checkpoint (its record too)
        meta = px.load_checkpoint(px.resume_from(), model_, opt, loader=loader)
        record.load_state_dict(meta["extra"]["record"])
    comm = px.Comm()
    began = time.monotonic()
    if regroup_victim:
        recover, held = state.recover, [False]

        def held_recover(*a, **k):  # type: ignore[no-untyped-def]
            # every survivor enters its first regroup only once Ray Train's controller is held (HeldConfig), so the
            # quorum's wait starts then, however long Ray took to get there; the victim parks inside it
            armed = os.path.exists(os.path.join(out, regroup_armed)) if regroup_armed else not state.history
            if armed and not held[0]:
                held[0] = True
                until(lambda: os.path.exists(os.path.join(out, "controller-held")), timeout=300,
                      what=f"worker {me}: the held controller")
                if me == regroup_victim:
                    park(out, "victim-regroup.json", me)  # inside the regroup, before arriving at the quorum
            return recover(*a, **k)
        state.recover = held_recover  # type: ignore[method-assign]
    if checkpoint:
        commit, join, joining = state.commit, state.join, [False]

        def saving_commit() -> None:  # after every save_every-th commit, where a port puts its torch.save
            commit()
            if state.step > 0 and state.step % (commit_every * save_every) == 0 and not joining[0]:
                path = os.path.join(checkpoint, f"step-{state.step}")
                px.save_checkpoint(path, model_, opt, loader=loader, step=state.step,
                                   extra={"record": record.state_dict()})
                if px.rank() == 0:
                    open(os.path.join(out, f"saved-{state.step}"), "w").close()

        def entering() -> bool:  # a joiner's own commit inside join() is not collective: no save there
            joining[0] = True
            try:
                return join()
            finally:
                joining[0] = False
        state.commit, state.join = saving_commit, entering  # type: ignore[method-assign]

    full: dict[int, int] = {}  # per ``/W`` group: the step from which the group has had W workers

    @px.elastic.run
    def train(state: px.elastic.State) -> None:
        for epoch, x, y, ids in epoch_batches(state, loader, epochs):
            for n, (these, at, after) in enumerate(groups):
                if after >= 0 and px.world_size() != after:
                    full.pop(n, None)
                elif after >= 0:
                    full.setdefault(n, state.step)  # the step at which the group last reached W workers
                due = state.step + 1 == at and len(state.history) == n if after < 0 else (
                    state.step + 1 >= at and n in full and state.step - full[n] >= commit_every)
                if me in these and due:
                    park(out, "victim.json" if n == 0 and len(these) == 1 else f"victim{me}.json", me, stop)
            record.steps.append([epoch, px.world_size(), group_ids(comm, ids, BATCH)])  # the whole group's
            take_step(model_, opt, x, y, loss=F.mse_loss)
            with open(os.path.join(out, "steps.jsonl"), "a") as f:
                f.write(json.dumps({"id": me, "step": state.step, "t": time.time()}) + "\n")
            if px.world_size() < slow_below and not (slow_first and state.history):
                wait_for_joiner(state, deadline=began + slow_for)

    train(state)
    write_worker(out, me, model_, record.steps, state.history, pid=os.getpid(), rank=px.rank())
    return {"id": me, "steps": state.step}


@dataclass
class HeldConfig(PhalanxConfig):
    """:class:`PhalanxConfig` whose backend holds the controller in every replacement's start until
    ``out/release-controller`` (bounded: ``hold_s``), having written ``out/controller-held``."""

    out: str = ""
    hold_s: float = 120.0
    armed: str = ""  # if set: only replacements started once ``out/<armed>`` exists are held


    @property
    def backend_cls(self) -> type:
        return HeldBackend


class HeldBackend(_PhalanxBackend):
    def on_start(self, worker_group, backend_config) -> None:  # type: ignore[no-untyped-def]
        armed = not backend_config.armed or os.path.exists(os.path.join(backend_config.out, backend_config.armed))
        if self.job is not None and armed:  # a replacement: Ray Train's controller waits here, its view of the workers
            open(os.path.join(backend_config.out, "controller-held"), "w").close()
            try:
                until(lambda: os.path.exists(os.path.join(backend_config.out, "release-controller")),
                      timeout=backend_config.hold_s, what="the test's release of the controller")
            except AssertionError:
                pass  # bounded: the test decides what a late release means
        super().on_start(worker_group, backend_config)
