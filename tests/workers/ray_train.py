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
so it enters before training ends.
"""
from __future__ import annotations

import glob
import json
import os
import signal
import time

import torch.nn.functional as F

import phalanx as px
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

    def next_commit_lets_one_in() -> bool:
        asked = set(json.loads(store.get(key("joiners")))) - members if store.check([key("joiners")]) else set()
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


def main(out: str, kill: str = "", epochs: int = 2, commit_every: int = 2, slow_below: int = 0,
         stop: bool = False, late: bool = False) -> dict:
    me = elastic_id()
    spec, _, at = kill.partition("@")
    victims = spec.split(",") if spec else []
    open(os.path.join(out, f"start{me}-{os.getpid()}"), "w").close()  # a restarted worker would leave a second one
    if late and me.startswith("r"):
        wait_for_the_end(out, victims, timeout=300)
        open(os.path.join(out, f"late-{me}"), "w").close()  # it reached px.init() after the others had finished
    px.init()
    model_, opt, loader, record, state = setup(commit_every, strategy=px.AllReduce())
    comm = px.Comm()
    began = time.monotonic()

    @px.elastic.run
    def train(state: px.elastic.State) -> None:
        for epoch, x, y, ids in epoch_batches(state, loader, epochs):
            if me in victims and state.step + 1 == int(at) and not state.history:
                name = "victim.json" if len(victims) == 1 else f"victim{me}.json"
                with open(os.path.join(out, f"{name}.tmp"), "w") as f:
                    json.dump({"id": me, "pid": os.getpid(), "time": time.time()}, f)
                os.replace(os.path.join(out, f"{name}.tmp"), os.path.join(out, name))  # whole or absent
                if stop:  # hung: only the heartbeat watcher in Ray's controller can free the others
                    os.kill(os.getpid(), signal.SIGSTOP)
                while True:  # parked until the test kills this process (kill -9)
                    signal.pause()
            record.steps.append([epoch, px.world_size(), group_ids(comm, ids, BATCH)])  # the whole group's
            take_step(model_, opt, x, y, loss=F.mse_loss)
            if px.world_size() < slow_below:
                wait_for_joiner(state, deadline=began + 120)

    train(state)
    write_worker(out, me, model_, record.steps, state.history, pid=os.getpid(), rank=px.rank())
    return {"id": me, "steps": state.step}
