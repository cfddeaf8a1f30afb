"""An elastic training loop kept at module level (no function): ``for epoch in state.epochs(n): with state:``.

Run with ``phalanx run --elastic -n 3 tests/workers/elastic_loop.py --out DIR [--kill ID@STEP]``
or plainly with ``python``. Per step it records the sample ids the whole group trained on
(rolled back with the commits); at the end each worker writes its id, final parameters and
that record to ``--out``. ``--kill 1@5`` SIGKILLs the worker started as rank 1 before step 5.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import phalanx as px  # noqa: E402
from workers.elastic import BATCH, Record, dataset, model, optimizer  # noqa: E402

p = argparse.ArgumentParser()
p.add_argument("--out", required=True)
p.add_argument("--epochs", type=int, default=2)
p.add_argument("--commit-every", type=int, default=3)
p.add_argument("--kill", default="", help="ID@STEP: the worker started as rank ID dies before step STEP")
args = p.parse_args()
me = os.environ.get("PHALANX_ELASTIC_ID", os.environ.get("RANK", "0"))
victim, _, at = args.kill.partition("@")

px.init()
net = model()
model_, opt = px.wrap(net, optimizer(net))
loader = px.shard(dataset(), batch_size=BATCH, seed=0)
record = Record()
state = px.elastic.State(model_, opt, loader, commit_every=args.commit_every, extra={"record": record})
comm = px.Comm()

for epoch in state.epochs(args.epochs):   # was: for epoch in range(args.epochs):
    with state:                           # a lost worker ends this block; the loop goes on from the commit
        loader.set_epoch(epoch)
        for x, y, ids in loader:
            if me == victim and len(record.steps) + 1 == int(at) and not state.history:
                os.kill(os.getpid(), signal.SIGKILL)
            padded = torch.cat([ids, torch.full((BATCH - len(ids),), -1, dtype=ids.dtype)])
            everyone = torch.cat(comm.all_gather(padded))  # what the whole group trains on at this step
            record.steps.append([epoch, px.world_size(), everyone[everyone >= 0].tolist()])
            opt.zero_grad()
            F.mse_loss(model_(x), y).backward()
            opt.step()

with open(os.path.join(args.out, f"worker{me}.json"), "w") as f:
    json.dump({"id": me, "world_size": px.world_size(), "record": record.steps, "history": state.history,
               "params": [t.tolist() for t in px.unwrap(model_).parameters()]}, f)
