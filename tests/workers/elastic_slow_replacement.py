"""A worker killed at a commit point under ``--replace``; its replacement starts up slowly.

Run with ``phalanx run --elastic -n 3 --min-workers 2 --replace tests/workers/elastic_slow_replacement.py
--out OUT``. Commits every 2 steps; worker 1 SIGKILLs itself inside the commit of step 4 (a kill at a
commit point). Its replacement ``r1`` gets its place from ``px.init()`` and then does not go on starting
up (building its model, reaching training) until the survivors have trained ``--survivor-steps`` steps
without it: they write ``OUT/survivors-stepped`` when they have, and then wait (in their loop) until the
replacement is ready to enter (``elastic/ready/r1`` in the store), so that training cannot end before it.
A replacement whose start-up blocked the survivors waits for that file in vain: after ``--give-up``
seconds it exits 3 ("the survivors never trained while I started up"). Every worker that finishes writes
what it trained to ``OUT/worker<id>.json``.
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
from phalanx.elastic.membership import key  # noqa: E402
from support.wait import until  # noqa: E402
from workers.elastic import BATCH, Record, dataset, model, optimizer  # noqa: E402

KILL_AT = 4


class KillInCommit:
    """An ``extra`` of the state whose capture SIGKILLs this process: a kill at a commit point."""

    def __init__(self, record: Record, armed: bool) -> None:
        self.record, self.armed = record, armed

    def state_dict(self) -> dict:
        if self.armed and len(self.record.steps) == KILL_AT:
            os.kill(os.getpid(), signal.SIGKILL)
        return {}

    def load_state_dict(self, state: dict) -> None:
        self.armed = False


def wait_until_ready(state: px.elastic.State, joiner: str, give_up: float) -> None:
    """Survivors, once they trained without it: wait until the replacement is ready (the key phalanx writes
    when a joiner reaches training), so that training does not end before it could join on a loaded machine."""
    try:
        until(lambda: state.worker.store.check([key("ready", joiner)]), timeout=give_up, what=f"{joiner} ready")
    except AssertionError as err:
        raise SystemExit(f"worker {os.environ.get('PHALANX_ELASTIC_ID')}: {err}") from None


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--survivor-steps", type=int, default=3)
    p.add_argument("--give-up", type=float, default=90.0)
    args = p.parse_args()
    me = os.environ.get("PHALANX_ELASTIC_ID", "0")
    stepped = os.path.join(args.out, "survivors-stepped")

    px.init()
    if me.startswith("r"):  # the replacement, placed: its start-up goes on once the survivors trained without it
        with open(os.path.join(args.out, f"init{me}.json"), "w") as f:
            json.dump({"rank": px.rank(), "world_size": px.world_size()}, f)
        try:
            until(lambda: os.path.exists(stepped), timeout=args.give_up, what="the survivors training without it")
        except AssertionError:
            print(f"replacement {me}: the survivors never trained while I started up", file=sys.stderr)
            raise SystemExit(3) from None
    net, data = model(), dataset()
    model_, opt = px.wrap(net, optimizer(net))
    loader = px.shard(data, batch_size=BATCH, seed=0)
    record = Record()
    state = px.elastic.State(model_, opt, loader, commit_every=2,
                             extra={"record": record, "kill": KillInCommit(record, me == "1")})
    without = []  # steps this survivor trained while the group was smaller than at the start

    @px.elastic.run
    def train(state: px.elastic.State) -> None:
        for epoch in range(state.epoch, args.epochs):
            loader.set_epoch(epoch)
            for x, y, ids in loader:
                everyone = torch.cat(px.Comm().all_gather(
                    torch.cat([ids, torch.full((BATCH - len(ids),), -1, dtype=ids.dtype)])))
                record.steps.append([epoch, px.world_size(), everyone[everyone >= 0].tolist()])
                opt.zero_grad()
                F.mse_loss(model_(x), y).backward()
                opt.step()
                if px.world_size() == 2:
                    without.append(state.step)
                    if len(without) == args.survivor_steps:
                        open(stepped, "w").close()
                        wait_until_ready(state, "r1", args.give_up)

    train(state)
    with open(os.path.join(args.out, f"worker{me}.json"), "w") as f:
        json.dump({"id": me, "record": record.steps, "history": state.history, "without": without,
                   "params": [t.tolist() for t in px.unwrap(model_).parameters()]}, f)


if __name__ == "__main__":
    main()
