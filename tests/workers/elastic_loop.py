"""An elastic training loop kept at module level (no function): ``for epoch in state.epochs(n): with state:``.

Run with ``phalanx run --elastic -n 3 tests/workers/elastic_loop.py --out DIR [--kill ID@STEP]``
or plainly with ``python``. Per step it records the sample ids the whole group trained on
(rolled back with the commits); at the end each worker writes its id, final parameters and
that record to ``--out``. ``--kill 1@5`` SIGKILLs the worker started as rank 1 before step 5.
"""
from __future__ import annotations

import os
import sys

import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import phalanx as px  # noqa: E402
from support.loop import elastic_id, elastic_parser, group_ids, kill_if_victim, take_step, write_worker  # noqa: E402
from workers.elastic import BATCH, setup  # noqa: E402

args = elastic_parser().parse_args()
me = elastic_id()

px.init()
model_, opt, loader, record, state = setup(args.commit_every)
comm = px.Comm()

for epoch in state.epochs(args.epochs):   # was: for epoch in range(args.epochs):
    with state:                           # a lost worker ends this block; the loop goes on from the commit
        loader.set_epoch(epoch)
        for x, y, ids in loader:
            kill_if_victim(state, me, args.kill)
            record.steps.append([epoch, px.world_size(), group_ids(comm, ids, BATCH)])  # the whole group's
            take_step(model_, opt, x, y, loss=F.mse_loss)

write_worker(args.out, me, model_, record.steps, state.history)
