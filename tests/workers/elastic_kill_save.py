"""A worker killed while ``px.elastic.State(checkpoint=DIR)`` writes its checkpoint at a commit.

Run with ``phalanx run --elastic -n 3 tests/workers/elastic_kill_save.py --out OUT --ckpt DIR --hold ID@WHERE``.
Every commit (every 3 steps) also writes the checkpoint. At the save of step 6, worker ID stops
at WHERE and holds there, after writing ``OUT/holding.json`` (its id and pid): the marker at which
the test SIGKILLs it. WHERE is one of

* ``enter``: before it enters the save (the others wait for every worker to enter);
* ``write``: inside DCP's write of its data (the others are in DCP's collectives);
* ``commit``: rank 0, after DCP wrote, before the directory is put in place (the others wait for its word).

Each survivor writes what it trained (as ``tests/workers/elastic_commit.py``) to ``OUT/worker<id>.json``.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import threading

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import phalanx as px  # noqa: E402
from phalanx.checkpoint import handle, saver  # noqa: E402
from workers.elastic import BATCH, Record, dataset, model  # noqa: E402
from workers.elastic_commit import SCALE, optimizer  # noqa: E402

HOLD_AT_STEP = 6


def hold(out: str, me: str) -> None:
    """Say where we are (the test's marker), then wait there until the test kills us."""
    with open(os.path.join(out, "holding.tmp"), "w") as f:
        json.dump({"id": me, "pid": os.getpid()}, f)
    os.replace(os.path.join(out, "holding.tmp"), os.path.join(out, "holding.json"))
    threading.Event().wait()


def arm(where: str, out: str, me: str, state_step) -> None:
    """Make this worker hold at ``where`` during the save of step HOLD_AT_STEP (once, before any regroup)."""
    due = lambda: state_step() == HOLD_AT_STEP  # noqa: E731

    if where == "enter":
        enter = saver._all_enter

        def held_enter(what: str):
            if due():
                hold(out, me)
            return enter(what)
        saver._all_enter = held_enter
    elif where == "write":
        make = saver._writer

        def held_writer(tmp: str):
            writer = make(tmp)
            write = writer.write_data

            def write_data(plan, planner):
                if due():
                    hold(out, me)
                return write(plan, planner)
            writer.write_data = write_data
            return writer
        saver._writer = held_writer
    elif where == "commit":
        commit = handle._commit

        def held_commit(tmp: str, path: str, world: int, step: int) -> None:
            if due():
                hold(out, me)
            commit(tmp, path, world, step)
        handle._commit = held_commit
    else:
        raise SystemExit(f"--hold ID@WHERE: WHERE is enter, write or commit, not {where!r}")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--ckpt", required=True)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--hold", default="", help="ID@WHERE: that worker holds at WHERE in the save of step 6")
    args = p.parse_args()
    me = os.environ.get("PHALANX_ELASTIC_ID", os.environ.get("RANK", "0"))
    victim, _, where = args.hold.partition("@")

    px.init()
    net, data = model(), dataset()
    model_, opt = px.wrap(net, optimizer(net))
    loader = px.shard(data, batch_size=BATCH, seed=0)
    scaler = torch.amp.GradScaler("cpu", init_scale=SCALE)
    record = Record()
    state = px.elastic.State(model_, opt, loader, commit_every=3, scaler=scaler, extra={"record": record},
                             checkpoint=args.ckpt)
    if me == victim:
        arm(where, args.out, me, lambda: state.step if not state.history else -1)

    @px.elastic.run
    def train(state: px.elastic.State) -> None:
        for epoch in range(state.epoch, args.epochs):
            loader.set_epoch(epoch)
            for x, y, ids in loader:
                everyone = torch.cat(px.Comm().all_gather(
                    torch.cat([ids, torch.full((BATCH - len(ids),), -1, dtype=ids.dtype)])))
                record.steps.append([epoch, px.world_size(), everyone[everyone >= 0].tolist(), False])
                opt.zero_grad()
                scaler.scale(F.mse_loss(model_(x), y)).backward()
                scaler.step(opt)
                scaler.update(SCALE)

    train(state)
    with open(os.path.join(args.out, f"worker{me}.json"), "w") as f:
        json.dump({"id": me, "pid": os.getpid(), "world_size": px.world_size(), "record": record.steps,
                   "params": [t.tolist() for t in px.unwrap(model_).parameters()], "history": state.history,
                   "step": state.step}, f)


if __name__ == "__main__":
    main()
