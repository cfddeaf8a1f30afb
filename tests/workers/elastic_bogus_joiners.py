"""Garbage in the store's joiners list: a value that is not JSON, then thousands of ids nobody admits.

Run with ``phalanx run --elastic -n 2 tests/workers/elastic_bogus_joiners.py --out OUT``. Every step
commits. Worker 0 writes into the launcher's store, on its own connection, as anyone who reaches the
store can: after step ``--garbage-at`` a value that does not parse, after step ``--bogus-at``
``--bogus`` joiner ids without a proof of the job's secret. Each worker counts the store calls of
each look for joiners to admit (what a commit point asks the store) and writes them, with what it
trained, to ``OUT/worker<id>.json``.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import phalanx as px  # noqa: E402
from phalanx.elastic.membership import key  # noqa: E402
from workers.elastic import BATCH, Record, dataset, model  # noqa: E402


class Counting:
    """The store, with its calls counted (the same store, the same connection: nothing is faked)."""

    def __init__(self, store) -> None:
        self.store, self.calls = store, 0

    def __getattr__(self, name: str):
        method = getattr(self.store, name)

        def counted(*args, **kwargs):
            self.calls += 1
            return method(*args, **kwargs)
        return counted


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--garbage-at", type=int, default=3)
    p.add_argument("--bogus-at", type=int, default=7)
    p.add_argument("--bogus", type=int, default=5000)
    args = p.parse_args()
    me = os.environ.get("PHALANX_ELASTIC_ID", "0")

    px.init()
    net, data = model(), dataset()
    model_, opt = px.wrap(net, torch.optim.SGD(net.parameters(), lr=0.05))
    loader = px.shard(data, batch_size=BATCH, seed=0)
    record = Record()
    state = px.elastic.State(model_, opt, loader, commit_every=1, extra={"record": record})
    worker, looks = state.worker, []
    look = worker.pending_joiners

    def counted_look() -> list[str]:  # a commit point's question to the store: whom to admit now
        counting = Counting(worker.store)
        worker.store = worker.membership.store = counting
        try:
            return look()
        finally:
            worker.store = worker.membership.store = counting.store
            looks.append([state.step, counting.calls])
    worker.pending_joiners = counted_look

    @px.elastic.run
    def train(state: px.elastic.State) -> None:
        for epoch in range(state.epoch, 2):
            loader.set_epoch(epoch)
            for x, y, ids in loader:
                record.steps.append([epoch, px.world_size(), ids.tolist(), False])
                opt.zero_grad()
                F.mse_loss(model_(x), y).backward()
                opt.step()
                if me == "0" and state.step == args.garbage_at:
                    worker.store.set(key("joiners"), b"\xff{not json")
                if me == "0" and state.step == args.bogus_at:
                    worker.store.set(key("joiners"), json.dumps([f"bogus-{i}" for i in range(args.bogus)]))

    train(state)
    with open(os.path.join(args.out, f"worker{me}.json"), "w") as f:
        json.dump({"id": me, "looks": looks, "steps": state.step, "history": state.history}, f)


if __name__ == "__main__":
    main()
