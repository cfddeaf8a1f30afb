"""A streaming training script for the elastic test: ``phalanx run --elastic -n 3 tests/workers/stream_elastic.py``.

Each step the group's entry ids (gathered from every worker) are appended to a record
that rolls back with the in-memory commit, so the survivors' record is the final
model's history. ``--kill ID@STEP`` kills the worker started as rank ID at STEP (SIGKILL); ``--term ID@STEP`` sends
it SIGTERM before STEP instead (it leaves at the next commit point), and ``--admit-at STEP`` then has the others wait
before STEP - 3 until its replacement asked to join (the commit point after offers it a place) and before STEP until
it is ready (it enters at the commit point after STEP; commits every 3 steps). The loop wraps ``opt.step()``
in ``try/except BaseException`` and notes what came out of it (``raised``): a membership change must come out of the
loader's iteration, never out of the step.
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
from workers.elastic import wait_for_joiner


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--url", required=True)
    p.add_argument("--stream", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--kill", default="", help="ID@STEP")
    p.add_argument("--term", default="", help="ID@STEP: SIGTERM to the worker started as rank ID before STEP")
    p.add_argument("--admit-at", type=int, default=0, help="STEP: once a worker left, wait before STEP - 3 until "
                   "its replacement asked to join, before STEP until it is ready")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--slow-after-loss", type=float, default=0.0, help="seconds per step once a worker was lost "
                   "(time for a replacement to start and join)")
    args = p.parse_args()
    me = os.environ.get("PHALANX_ELASTIC_ID", os.environ.get("RANK", "0"))
    victim, _, at = args.kill.partition("@")
    leaver, _, term_at = args.term.partition("@")
    px.init()
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
    model, opt = px.wrap(net, torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9))
    source = RedisStream(args.url, stream=args.stream, group="trainer", decode=decode_sample, create=True)
    loader = StreamLoader(source, args.batch_size, stop=Stop(idle_s=30), block_s=0.1)
    record = Record()
    state = px.elastic.State(model, opt, loader, commit_every=3, extra={"record": record})
    comm = px.Comm()
    raised: list[str] = []

    @px.elastic.run
    def train(state: px.elastic.State) -> None:
        for x, y in loader:
            if me == victim and state.step + 1 == int(at) and not state.history:
                os.kill(os.getpid(), signal.SIGKILL)
                signal.pause()  # (SIGKILL is not handled: the process is gone before this returns)
            if me == leaver and state.step + 1 == int(term_at) and not state.history:
                os.kill(os.getpid(), signal.SIGTERM)  # the handler only notes it: the worker leaves at a commit point
            if state.step + 1 in (args.admit_at - 3, args.admit_at) and state.history \
                    and not any(h["joined"] for h in state.history):
                # the next commit point offers the replacement a place, the one after admits it
                wait_for_joiner(state, "ready" if state.step + 1 == args.admit_at else "asked")
            record.steps.append([i for ids in comm.all_gather_state(loader.ids) for i in ids])
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            try:
                opt.step()
            except BaseException as err:  # what a loop may wrap its step in: a change must not come from here
                raised.append(f"{type(err).__name__} at step {state.step}")
                raise
            if state.history and not any(h["joined"] for h in state.history):
                # A real process is being started (the replacement): the survivors slow down, bounded (only
                # until it has joined, at the regroup after the loss or later), so the stream still lasts when
                # it arrives. Not a synchronisation.
                time.sleep(args.slow_after_loss)  # sleep: survivors slowed so the stream outlasts the restart

    train(state)
    loader.state_dict()  # the final commit (a real run would save a checkpoint here) ...
    loader.close()  # ... acknowledged: nothing stays pending
    result = {"id": me, "world_size": px.world_size(), "record": record.steps, "history": state.history,
              "raised": raised,
              "pending": source.pending() if px.is_main() else -1}
    with open(os.path.join(args.out, f"worker{me}.json"), "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
