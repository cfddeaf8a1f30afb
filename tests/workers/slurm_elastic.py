"""An elastic job across a SLURM allocation's nodes (run by tests/launch/test_slurm.py).

    srun phalanx run -n 1 --elastic --min-workers 1 slurm_elastic.py --out DIR

Node 0's worker ("0") trains alone until node 1's worker (a joiner) has asked to join, so
the group is sure to reach 2; two steps after it did, worker "0" dies with SIGKILL (a
node lost) and node 1's worker goes on alone from the last commit. Each survivor writes
``DIR/worker<ID>.json``: its id, per step (epoch, world size, the group's sample ids) and
its final parameters, for the one-process oracle of tests/workers/elastic.py.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import sys

import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import phalanx as px  # noqa: E402
from phalanx.elastic.membership import key  # noqa: E402
from workers.elastic import BATCH, Record, dataset, model, optimizer  # noqa: E402
from support.loop import group_ids, take_step, write_worker  # noqa: E402
from support.wait import until  # noqa: E402


def joiner_waiting(state: px.elastic.State) -> bool:
    """The next commit point lets a joiner in: one asked and has no place offered yet (that commit offers it one), or
    one offered a place is ready to enter (started up, waiting at the start of training: that commit admits it).

    Waiting for *ready* before the offer would hold back the very commit point that makes the offer: nobody moves.
    """
    store = state.worker.store
    asked = json.loads(store.get(key("joiners"))) if store.check([key("joiners")]) else []
    return any(not store.check([key("offer", j)]) or store.check([key("ready", j)]) for j in asked)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--epochs", type=int, default=2)
    args = p.parse_args()
    me = os.environ["PHALANX_ELASTIC_ID"]
    px.init()
    net = model()
    model_, opt = px.wrap(net, optimizer(net))
    loader = px.shard(dataset(), batch_size=BATCH, seed=0)
    record = Record()
    # A commit point after every step: the joiner is offered its place at the first (step 1) and enters at the one
    # after it is ready (step 2), so the group trains at 2 for the third and fourth steps whatever the timing. Which
    # steps run at 2 decides the float32 rounding against the one-process oracle: this job's worker is bit-identical
    # to a two-way all-reduce replayed in one process, and entering at step 4 (commit_every=2) rounds 2.6e-6 away.
    state = px.elastic.State(model_, opt, loader, commit_every=1, extra={"record": record})
    comm = px.Comm()
    for epoch in state.epochs(args.epochs):
        with state:
            loader.set_epoch(epoch)
            for x, y, ids in loader:
                if me == "0" and px.world_size() == 1 and not state.history:  # alone so far: wait for node 1's
                    until(lambda: joiner_waiting(state), timeout=120, what="node 1's joiner")  # (it starts slower)
                if me == "0" and sum(row[1] == 2 for row in record.steps) == 2:
                    os.kill(os.getpid(), signal.SIGKILL)  # the node is lost mid-epoch
                record.steps.append([epoch, px.world_size(), group_ids(comm, ids, BATCH)])
                take_step(model_, opt, x, y, loss=F.mse_loss)
    write_worker(args.out, me, model_, record.steps, state.history)


if __name__ == "__main__":
    main()
