"""A user's loop with its own iterator (no ``px.shard``), Horovod's way: ``opt.step()``, then ``state.commit()``.

``phalanx run -n 2 --elastic --max-workers 3 tests/workers/elastic_plain.py --out DIR``, and ``phalanx join -n 1``
with the same script once both train. The loop wraps ``opt.step()`` in ``try/except BaseException`` and notes
anything raised there (``raised`` in ``worker<ID>.json``): a membership change must come out of ``state.commit()``,
the call the loop wrote (every 3rd step), never out of the step; ``commit_every=2`` still takes a commit after
``opt.step()`` at the steps between, a snapshot that decides nothing. The members wait before step 3 until the
joiner asked to join and before step 6 until it is ready (it enters at the commit point of step 6); ``--term
ID@STEP`` sends SIGTERM to the worker ID before step STEP (it leaves at the next commit point, step 12 for 1@10;
the others regroup there and redo nothing).

The data is the user's own: the epoch's shuffled order cut into global batches of ``BATCH`` per worker, this rank's
part read from a position (samples of the epoch done) that rides in every commit (``extra=``). At an epoch's tail
some ranks get fewer samples, or none: each rank's loss is its samples' sum over the global batch, times the world
size, so the group's mean gradient is the one-process gradient of the mean over the global batch (the oracle).
"""
from __future__ import annotations

import os
import signal
from typing import Iterator

import torch
import torch.nn.functional as F

import phalanx as px
from support.loop import elastic_id, elastic_parser, group_ids, write_worker
from workers.elastic import BATCH, N, Record, dataset, model, optimizer, wait_for_joiner


class Position:
    """Where the user's iterator stands: the epoch and the samples of it the group has taken (committed)."""

    def __init__(self) -> None:
        self.epoch, self.done = 0, 0

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "done": self.done}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.done = int(state["epoch"]), int(state["done"])


def batches(position: Position, epochs: int) -> Iterator[tuple[int, torch.Tensor, int]]:
    """The user's own iterator: ``(epoch, this rank's sample ids, the global batch's size)``, from ``position``.

    Read at every step from the group as it is now, so after a change it goes on over the new world."""
    while position.epoch < epochs:
        order = torch.randperm(N, generator=torch.Generator().manual_seed(position.epoch))
        while position.done < N:
            world, rank = px.world_size(), px.rank()
            chunk = order[position.done:position.done + world * BATCH]
            position.done += len(chunk)
            yield position.epoch, chunk[rank * BATCH:(rank + 1) * BATCH], len(chunk)
        position.epoch, position.done = position.epoch + 1, 0


def oracle(record: list) -> list[torch.Tensor]:
    """One process on the same global batches, the mean loss over each."""
    net, data = model(), dataset()
    opt = optimizer(net)
    for _epoch, _world, ids in record:
        x, y, _ = data[torch.tensor(ids)]
        opt.zero_grad()
        F.mse_loss(net(x), y).backward()
        opt.step()
    return [p.detach() for p in net.parameters()]


def main() -> None:
    p = elastic_parser(commit_every=2, kill=False)
    p.add_argument("--term", default="", help="ID@STEP: SIGTERM to the worker ID before step STEP")
    p.add_argument("--no-commit", action="store_true", help="a loop that never calls state.commit()")
    args = p.parse_args()
    me = elastic_id()
    px.init()
    data = dataset()
    net = model()
    model_, opt = px.wrap(net, optimizer(net))
    position, record, raised = Position(), Record(), []
    state = px.elastic.State(model_, opt, commit_every=args.commit_every,
                             extra={"position": position, "record": record})
    comm = px.Comm()
    victim, _, at = args.term.partition("@")

    @px.elastic.run
    def train(state: px.elastic.State) -> None:
        for epoch, ids, size in batches(position, args.epochs):
            if not state.history and state.step in (2, 5) and me in ("0", "1") and not args.no_commit:
                wait_for_joiner(state, "asked" if state.step == 2 else "ready")
            if me == victim and state.step + 1 == int(at) and len(state.history) == (0 if args.no_commit else 1):
                os.kill(os.getpid(), signal.SIGTERM)  # the handler only notes it: the worker leaves at a commit
            record.steps.append([epoch, px.world_size(), group_ids(comm, ids, BATCH)])
            x, y, _ = data[ids]
            opt.zero_grad()
            (F.mse_loss(model_(x), y, reduction="sum") * px.world_size() / size).backward()
            try:
                opt.step()
            except BaseException as err:  # what a loop may wrap its step in: a change must not come from here
                raised.append(f"{type(err).__name__} at step {state.step}")
                raise
            # every 3rd step, as Horovod's examples commit every few batches
            if state.step % 3 == 0 and not args.no_commit:
                state.commit()  # the loop's commit point: a membership change comes out of this call
            if state.step == 1:
                open(os.path.join(args.out, f"training{me}"), "w").close()  # the test starts the joiner then

    train(state)
    write_worker(args.out, me, model_, record.steps, state.history, raised=raised, pid=os.getpid())


if __name__ == "__main__":
    main()
