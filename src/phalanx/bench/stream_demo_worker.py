"""The training script of ``phalanx demo --stream``, run by ``phalanx run --elastic --replace``.

Each worker trains the digits CNN from the stream under ``px.elastic.State``. Every step
the group's entry ids are gathered into a record that rolls back with the in-memory
commit, so at the end the record is exactly the history of the final model. Every step
each worker also appends what it trained to its own log file, rolled back or not, which
counts the events trained again after the loss. The worker started as id ``--kill``
SIGKILLs itself once the group has trained ``--kill-after`` events; its replacement
(id ``r<id>``) joins at a later commit point.

Run by the demo, not by hand::

    phalanx run -n 2 --elastic --min-workers 1 --replace SCRIPT --url URL --dir DIR

where SCRIPT calls :func:`main` (a script in this folder would shadow redis-py with redis.py).
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time


class Record:
    """The ids of every step, checkpointed with the model: it rolls back with the commit."""

    def __init__(self) -> None:
        self.steps: list[list[str]] = []

    def state_dict(self) -> dict:
        return {"steps": [list(s) for s in self.steps]}

    def load_state_dict(self, state: dict) -> None:
        self.steps = [list(s) for s in state["steps"]]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--url", required=True)
    p.add_argument("--dir", required=True)
    p.add_argument("--stream", default="digits")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--every", type=int, default=10)
    p.add_argument("--idle", type=float, default=20.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--kill", default="1")
    p.add_argument("--kill-after", type=int, default=2000)
    p.add_argument("--wait-step-s", type=float, default=0.25, help="seconds per step until the replacement joins")
    p.add_argument("--wait-join-s", type=float, default=120.0, help="bound on that slow-down, from the start")
    args = p.parse_args(argv)

    import torch
    import torch.nn.functional as F

    import phalanx as px
    from phalanx.bench.models import digits_cnn, load_digits_split
    from phalanx.stream import Deadline, RedisStream, Stop, StreamLoader, decode_sample

    me = os.environ.get("PHALANX_ELASTIC_ID", os.environ.get("RANK", "0"))
    px.init()
    torch.manual_seed(args.seed)
    net = digits_cnn()
    model, opt = px.wrap(net, torch.optim.Adam(net.parameters(), lr=args.lr))
    source = RedisStream(args.url, stream=args.stream, group="trainer", decode=decode_sample, create=True)
    loader = StreamLoader(source, args.batch_size, policy=Deadline(0.5), stop=Stop(idle_s=args.idle))
    record = Record()
    state = px.elastic.State(model, opt, loader, commit_every=args.every, extra={"record": record})
    comm = px.Comm()
    log = open(os.path.join(args.dir, f"ids.{me}.log"), "a")
    state_wait = [time.monotonic() + args.wait_join_s]

    @px.elastic.run
    def train(state: px.elastic.State) -> None:
        for x, y in loader:
            if me == args.kill and loader.events >= args.kill_after and not state.history:
                print(f"\n** worker {me} (pid {os.getpid()}) is killed by SIGKILL after {loader.events} events **",
                      file=sys.stderr, flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
                time.sleep(60)
            record.steps.append([i for ids in comm.all_gather_state(loader.ids) for i in ids])
            log.write(" ".join(loader.ids) + "\n")
            log.flush()
            opt.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            if len(state.history) == 1 and time.monotonic() < state_wait[0]:
                # A worker was lost and its replacement is still starting (seconds: it imports torch): slow
                # down, so that it joins while the stream lasts (it enters at a commit point), bounded.
                time.sleep(args.wait_step_s)
            if px.is_main() and loader.steps % args.every == 0:
                s = loader.stats()
                print(f"  step {loader.steps:4d}  {px.world_size()} workers  loss {loss.item():.3f}  "
                      f"lag {s['lag']:5d}  trained {s['events']:5d} events up to {loader.position}", flush=True)

    train(state)
    loader.state_dict()  # the final commit (a real run would save a checkpoint here) ...
    loader.close()  # ... acknowledged: nothing stays pending
    if me == "0":  # the worker started as rank 0 (never the one killed); a late replacement finds nothing left
        _, test = load_digits_split()
        with torch.no_grad():
            accuracy = (px.unwrap(model)(test.tensors[0]).argmax(1) == test.tensors[1]).float().mean().item()
        with open(os.path.join(args.dir, "summary.json"), "w") as f:
            json.dump({"test_accuracy": accuracy, "record": record.steps, "history": state.history,
                       "world_size": px.world_size(), "pending": source.pending()}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
