"""An elastic job that trains until told to stop: ``phalanx run --elastic -n 2 tests/workers/elastic_door.py --out D``.

The tests that knock on a running job's door (a join without the secret, a stray
joiner name written into the store) need the job to be still training when they
knock, however loaded the machine. This job trains the model of ``workers/elastic.py``
epoch after epoch until the file ``D/stop`` exists; every worker reads the file at
every step and the group agrees on it with an all-reduce, so all stop at the same step.
At the end each worker writes ``D/worker<id>.json`` as ``workers/elastic.py`` does.
"""
from __future__ import annotations

import argparse
import atexit
import json
import os
import sys
import threading

import torch
import torch.distributed as dist
import torch.nn.functional as F
from support.wait import until

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import phalanx as px  # noqa: E402
from workers.elastic import BATCH, Record, dataset, model, optimizer  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--commit-every", type=int, default=2)
    p.add_argument("--fail-at", type=int, default=0, help="every worker exits with status 3 at this step")
    p.add_argument("--save", action="store_true", help="px.save_checkpoint to OUT/ckpt.pt just before --fail-at")
    p.add_argument("--idle-joiner", action="store_true",
                   help="a joiner builds its State, then never trains (never calls train(state)) until OUT/stop")
    p.add_argument("--threads-at-exit", default=None, help="write the threads still running at exit to this file")
    args = p.parse_args()
    if args.threads_at_exit:  # registered first, so it runs last of the exit handlers: after phalanx's own
        atexit.register(lambda: open(args.threads_at_exit, "w").write(json.dumps(
            [t.name for t in threading.enumerate() if t is not threading.main_thread()])))
    me = os.environ.get("PHALANX_ELASTIC_ID", os.environ.get("RANK", "0"))
    px.init()
    net, data = model(), dataset()
    model_, opt = px.wrap(net, optimizer(net), strategy=px.AllReduce())
    loader = px.shard(data, batch_size=BATCH, seed=0)
    record = Record()
    state = px.elastic.State(model_, opt, loader, commit_every=args.commit_every, extra={"record": record})
    comm = px.Comm()
    if args.idle_joiner and os.environ.get("PHALANX_ELASTIC_JOIN") == "1":
        with open(os.path.join(args.out, f"idle{me}"), "w") as f:  # the place px.init() gave it
            json.dump({"rank": px.rank(), "world_size": px.world_size()}, f)
        # a script that believed it was alone, until the test ends it
        until(lambda: os.path.exists(os.path.join(args.out, "stop")), timeout=600, what="the stop file")
        return

    @px.elastic.run
    def train(state: px.elastic.State) -> None:
        for epoch in range(state.epoch, 10_000):
            loader.set_epoch(epoch)
            for x, y, ids in loader:
                stop = torch.tensor([float(os.path.exists(os.path.join(args.out, "stop")))])
                dist.all_reduce(stop)
                if stop.item() > 0:
                    return
                if state.step + 1 == args.fail_at:  # a bug every worker hits: the whole job is gone
                    if args.save:
                        px.save_checkpoint(os.path.join(args.out, "ckpt.pt"), model_, opt, loader=loader,
                                           step=state.step)
                    raise SystemExit(3)
                padded = torch.cat([ids, torch.full((BATCH - len(ids),), -1, dtype=ids.dtype)])
                everyone = torch.cat(comm.all_gather(padded))
                record.steps.append([epoch, px.world_size(), everyone[everyone >= 0].tolist()])
                opt.zero_grad()
                F.mse_loss(model_(x), y).backward()
                opt.step()
                if state.step == 1:
                    open(os.path.join(args.out, f"training{me}"), "w").close()

    train(state)
    result = {"steps": state.step, "id": me, "pid": os.getpid(), "rank": px.rank(), "world_size": px.world_size(),
              "record": record.steps, "params": [t.tolist() for t in px.unwrap(model_).parameters()],
              "history": state.history}
    with open(os.path.join(args.out, f"worker{me}.json"), "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
