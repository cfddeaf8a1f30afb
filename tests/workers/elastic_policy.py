"""Elastic resize policies, strategies, kills: ``phalanx run --elastic -n 3 tests/workers/elastic_policy.py``.

The same model and data as ``tests/workers/elastic.py``. Each worker records, per
optimizer step, the sample ids the whole group trained on (rolled back with the
state), and at the end writes its id, pid, rank, final parameters, membership
history and the time of its first step after the recovery to ``--out``.
``--kill ID@STEP`` kills the worker started as rank ID at STEP with SIGKILL.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import time

import torch
import torch.nn.functional as F
try:  # run as a script by `phalanx run`: this file's directory, tests/workers, is on sys.path
    from elastic import STRATEGIES, Record, dataset, model, optimizer
except ImportError:  # imported as workers.elastic_policy (pytest's doctest collection)
    from workers.elastic import STRATEGIES, Record, dataset, model, optimizer

import phalanx as px

POLICIES = {"worker": lambda: px.elastic.KeepWorkerBatch(), "global": lambda: px.elastic.KeepGlobalBatch()}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--commit-every", type=int, default=3)
    p.add_argument("--kill", default="", help="ID@STEP: the worker started as rank ID dies at STEP")
    p.add_argument("--resize", default="worker", choices=sorted(POLICIES))
    p.add_argument("--strategy", default="allreduce", choices=sorted(STRATEGIES))
    args = p.parse_args()
    me = os.environ["PHALANX_ELASTIC_ID"]
    victim, _, at = args.kill.partition("@")
    with open(os.path.join(args.out, f"start{me}-{os.getpid()}.json"), "w") as f:
        json.dump({"id": me, "pid": os.getpid()}, f)  # a restarted worker would leave a second one
    px.init()
    started_with = px.world_size()
    net = model()
    model_, opt = px.wrap(net, optimizer(net), strategy=STRATEGIES[args.strategy]())
    loader = px.shard(dataset(), batch_size=args.batch, seed=0)
    record = Record()
    state = px.elastic.State(model_, opt, loader, commit_every=args.commit_every, extra={"record": record},
                             resize=POLICIES[args.resize]())
    comm = px.Comm()
    width = args.batch * started_with  # no worker's part of a global batch is larger
    first_after: list[float] = []

    @px.elastic.run
    def train(state: px.elastic.State) -> None:
        for epoch in range(state.epoch, args.epochs):
            loader.set_epoch(epoch)
            for x, y, ids in loader:
                if me == victim and state.step + 1 == int(at) and not state.history:
                    with open(os.path.join(args.out, "killed.json"), "w") as f:
                        json.dump({"id": me, "pid": os.getpid(), "time": time.time()}, f)
                    os.kill(os.getpid(), signal.SIGKILL)
                padded = torch.cat([ids, torch.full((width - len(ids),), -1, dtype=ids.dtype)])
                everyone = torch.cat(comm.all_gather(padded))  # what the whole group trains on at this step
                record.steps.append([epoch, px.world_size(), everyone[everyone >= 0].tolist()])
                opt.zero_grad()
                F.mse_loss(model_(x), y).backward()
                opt.step()
                if state.history and not first_after:
                    first_after.append(time.time())

    train(state)
    px.strategy_of(opt).finish()  # replicas of LocalSGD/DiLoCo/EASGD reconcile: the model training ends with
    result = {"id": me, "pid": os.getpid(), "rank": px.rank(), "world_size": px.world_size(), "steps": state.step,
              "record": record.steps, "params": [t.tolist() for t in px.unwrap(model_).parameters()],
              "history": state.history, "first_step_after_recovery": first_after[0] if first_after else None}
    with open(os.path.join(args.out, f"worker{me}.json"), "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
