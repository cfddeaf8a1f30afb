"""A worker killed while ``px.elastic.State(checkpoint=DIR)`` writes its checkpoint at a commit.

Run with ``phalanx run --elastic -n 3 tests/workers/elastic_kill_save.py --out OUT --ckpt DIR --hold ID@WHERE``.
Every commit (every 3 steps) also writes the checkpoint. At the save of step 6, worker ID stops
at WHERE and holds there, after writing ``OUT/holding.json`` (its id and pid): the marker at which
the test SIGKILLs it (also written as ``OUT/holding<ID>.json``). WHERE is one of

* ``enter``: before it enters the save (the others wait for every worker to enter);
* ``write``: inside DCP's write of its data (the others are in DCP's collectives);
* ``commit``: rank 0, after DCP wrote, before the directory is put in place (the others wait for its word);
* ``finish``: worker ID (not rank 0) writes its data and goes on into DCP's last exchange; rank 0, once every
  worker's result reached it, stops in DCP's ``finish`` (the metadata write) after writing ``OUT/finishing.json``
  and goes on when the test wrote ``OUT/killed`` (the victim is dead then): rank 0's answer to the others then
  fails on the dead victim's connection while the others may already hold it, or wait for it.

``--hold ID@WHERE@STEP,...`` holds several workers in one run, each at the save of its own STEP (a save
no regroup has redone): the test kills them one after another.

Each survivor writes what it trained (as ``tests/workers/elastic_commit.py``) to ``OUT/worker<id>.json``.
"""
from __future__ import annotations

import json
import os
import sys
import threading

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import phalanx as px  # noqa: E402
from phalanx.checkpoint import handle, saver  # noqa: E402
from support.wait import until  # noqa: E402
from support.loop import elastic_id, elastic_parser, epoch_batches, group_ids, write_worker  # noqa: E402
from workers.elastic import BATCH, setup  # noqa: E402
from workers.elastic_commit import SCALE, optimizer  # noqa: E402

HOLD_AT_STEP = 6


def hold(out: str, me: str) -> None:
    """Say where we are (the test's marker), then wait there until the test kills us."""
    for name in ("holding.json", f"holding{me}.json"):
        mark(out, name, me)
    threading.Event().wait()


def mark(out: str, name: str, me: str) -> None:
    """Write ``OUT/name`` (this worker's id and pid) whole, and go on."""
    with open(os.path.join(out, f"{name}.tmp"), "w") as f:
        json.dump({"id": me, "pid": os.getpid()}, f)
    os.replace(os.path.join(out, f"{name}.tmp"), os.path.join(out, name))


def wrap_writer(method: str, before) -> None:
    """Make DCP's storage writer call ``before()`` at the start of its ``method`` (write_data, finish)."""
    make = saver._writer

    def wrapping_writer(tmp: str):
        writer = make(tmp)
        inner = getattr(writer, method)

        def wrapped(*args, **kwargs):
            before()
            return inner(*args, **kwargs)
        setattr(writer, method, wrapped)
        return writer
    saver._writer = wrapping_writer


def arm_rank0_finish(out: str, due) -> None:
    """Rank 0 stops in DCP's finish of the save where ``due()``, until the test says the victim is dead."""
    def wait_for_the_kill() -> None:
        if due():
            mark(out, "finishing.json", "0")
            until(lambda: os.path.exists(os.path.join(out, "killed")), timeout=300,
                  what="the test's word that the victim is dead")
    wrap_writer("finish", wait_for_the_kill)


def arm(where: str, out: str, me: str, state_step, at: int = HOLD_AT_STEP) -> None:
    """Make this worker hold at ``where`` during the save of step ``at`` (once: ``state_step`` says -1 after a
    regroup that went back to ``at`` or past it)."""
    due = lambda: state_step() == at  # noqa: E731

    if where == "enter":
        enter = saver._all_enter

        def held_enter(what: str):
            if due():
                hold(out, me)
            return enter(what)
        saver._all_enter = held_enter
    elif where == "write":
        wrap_writer("write_data", lambda: hold(out, me) if due() else None)
    elif where == "commit":
        commit = handle._commit

        def held_commit(tmp: str, path: str, world: int, step: int) -> None:
            if due():
                hold(out, me)
            commit(tmp, path, world, step)
        handle._commit = held_commit
    elif where == "finish":  # marks and goes on: the test kills it once rank 0 is finishing
        wrap_writer("write_data", lambda: mark(out, f"holding{me}.json", me) if due() else None)
    else:
        raise SystemExit(f"--hold ID@WHERE: WHERE is enter, write, commit or finish, not {where!r}")


def main() -> None:
    p = elastic_parser(commit_every=None, kill=False)
    p.add_argument("--ckpt", required=True)
    p.add_argument("--hold", default="", help="ID@WHERE[@STEP][,...]: that worker holds at WHERE in the save of "
                   f"step STEP ({HOLD_AT_STEP} if not given)")
    args = p.parse_args()
    me = elastic_id()
    holds = {wid: (where, int(at or HOLD_AT_STEP)) for wid, where, at in
             ((h.split("@") + [""])[:3] for h in args.hold.split(",") if h)}

    px.init()
    scaler = torch.amp.GradScaler("cpu", init_scale=SCALE)
    model_, opt, loader, record, state = setup(3, optimizer, scaler=scaler, checkpoint=args.ckpt)
    def stepped(at: int):  # the state's step, or -1 once a regroup went back to the save of ``at`` or past it
        return lambda: state.step if all(h["step"] < at for h in state.history) else -1
    if me in holds:
        where, at = holds[me]
        arm(where, args.out, me, stepped(at), at)
    for where, at in holds.values():
        if where == "finish" and me == "0":
            arm_rank0_finish(args.out, lambda at=at: stepped(at)() == at)

    @px.elastic.run
    def train(state: px.elastic.State) -> None:
        for epoch, x, y, ids in epoch_batches(state, loader, args.epochs):
            record.steps.append([epoch, px.world_size(), group_ids(px.Comm(), ids, BATCH), False])
            opt.zero_grad()
            scaler.scale(F.mse_loss(model_(x), y)).backward()
            scaler.step(opt)
            scaler.update(SCALE)

    train(state)
    write_worker(args.out, me, model_, record.steps, state.history, pid=os.getpid(), step=state.step)


if __name__ == "__main__":
    main()
