"""Elastic resize policies, strategies, kills: ``phalanx run --elastic -n 3 tests/workers/elastic_policy.py``.

The same model and data as ``tests/workers/elastic.py``. Each worker records, per
optimizer step, the sample ids the whole group trained on (rolled back with the
state), and at the end writes its id, pid, rank, final parameters, membership
history and the time of its first step after the recovery to ``--out``.
``--kill ID@STEP`` kills the worker started as rank ID at STEP with SIGKILL.
"""
from __future__ import annotations

import json
import os
import time

import torch.nn.functional as F
try:  # run as a script by `phalanx run`: this file's directory, tests/workers, is on sys.path
    from elastic import STRATEGIES, setup
except ImportError:  # imported as workers.elastic_policy (pytest's doctest collection)
    from workers.elastic import STRATEGIES, setup

import phalanx as px
from support.loop import elastic_id, elastic_parser, epoch_batches, group_ids, kill_if_victim, take_step, write_worker

POLICIES = {"worker": lambda: px.elastic.KeepWorkerBatch(), "global": lambda: px.elastic.KeepGlobalBatch()}


def main() -> None:
    p = elastic_parser()
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--resize", default="worker", choices=sorted(POLICIES))
    p.add_argument("--strategy", default="allreduce", choices=sorted(STRATEGIES))
    args = p.parse_args()
    me = elastic_id()
    with open(os.path.join(args.out, f"start{me}-{os.getpid()}.json"), "w") as f:
        json.dump({"id": me, "pid": os.getpid()}, f)  # a restarted worker would leave a second one
    px.init()
    started_with = px.world_size()
    model_, opt, loader, record, state = setup(args.commit_every, strategy=STRATEGIES[args.strategy](),
                                               batch=args.batch, resize=POLICIES[args.resize]())
    comm = px.Comm()
    width = args.batch * started_with  # no worker's part of a global batch is larger
    first_after: list[float] = []

    @px.elastic.run
    def train(state: px.elastic.State) -> None:
        for epoch, x, y, ids in epoch_batches(state, loader, args.epochs):
            kill_if_victim(state, me, args.kill, first=lambda: killed(args.out, me))
            record.steps.append([epoch, px.world_size(), group_ids(comm, ids, width)])  # the whole group's
            take_step(model_, opt, x, y, loss=F.mse_loss)
            if state.history and not first_after:
                first_after.append(time.time())

    train(state)
    px.strategy_of(opt).finish()  # replicas of LocalSGD/DiLoCo/EASGD reconcile: the model training ends with
    write_worker(args.out, me, model_, record.steps, state.history, pid=os.getpid(), rank=px.rank(),
                 steps=state.step, first_step_after_recovery=first_after[0] if first_after else None)


def killed(out: str, me: str) -> None:
    """``out/killed.json``: who is about to be killed, and when (the test times the recovery from it)."""
    with open(os.path.join(out, "killed.json"), "w") as f:
        json.dump({"id": me, "pid": os.getpid(), "time": time.time()}, f)


if __name__ == "__main__":
    main()
