"""A streaming training script for the elastic test: ``phalanx run --elastic -n 3 tests/workers/stream_elastic.py``.

Each step the group's entry ids (gathered from every worker) are appended to a record
that rolls back with the in-memory commit, so the survivors' record is the final
model's history. ``--kill ID@STEP`` kills the worker started as rank ID at STEP (SIGKILL).
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import time

import torch
import torch.nn.functional as F

import phalanx as px
from phalanx.stream import RedisStream, Stop, StreamLoader, decode_sample
from phalanx.bench.stream_demo_worker import Record  # the ids of every step, rolled back with the commit


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--url", required=True)
    p.add_argument("--stream", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--kill", default="", help="ID@STEP")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--slow-after-loss", type=float, default=0.0, help="seconds per step once a worker was lost "
                   "(time for a replacement to start and join)")
    args = p.parse_args()
    me = os.environ.get("PHALANX_ELASTIC_ID", os.environ.get("RANK", "0"))
    victim, _, at = args.kill.partition("@")
    px.init()
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
    model, opt = px.wrap(net, torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9))
    source = RedisStream(args.url, stream=args.stream, group="trainer", decode=decode_sample, create=True)
    loader = StreamLoader(source, args.batch_size, stop=Stop(idle_s=30), block_s=0.1)
    record = Record()
    state = px.elastic.State(model, opt, loader, commit_every=3, extra={"record": record})
    comm = px.Comm()

    @px.elastic.run
    def train(state: px.elastic.State) -> None:
        for x, y in loader:
            if me == victim and state.step + 1 == int(at) and not state.history:
                os.kill(os.getpid(), signal.SIGKILL)
                signal.pause()  # (SIGKILL is not handled: the process is gone before this returns)
            record.steps.append([i for ids in comm.all_gather_state(loader.ids) for i in ids])
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
            if state.history and not any(h["joined"] for h in state.history):
                # A real process is being started (the replacement): the survivors slow down, bounded (only
                # until it has joined, at the regroup after the loss or later), so the stream still lasts when
                # it arrives. Not a synchronisation.
                time.sleep(args.slow_after_loss)  # sleep: survivors slowed so the stream outlasts the restart

    train(state)
    loader.state_dict()  # the final commit (a real run would save a checkpoint here) ...
    loader.close()  # ... acknowledged: nothing stays pending
    result = {"id": me, "world_size": px.world_size(), "record": record.steps, "history": state.history,
              "pending": source.pending() if px.is_main() else -1}
    with open(os.path.join(args.out, f"worker{me}.json"), "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
