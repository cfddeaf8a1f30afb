"""Scripts for tests/checkpoint/test_checkpoint_async.py: asynchronous saves that fail, and one a lost worker cuts.

``python checkpoint_async.py full-disk FULL OTHER OUT`` (each rank, torchrun's variables set): an asynchronous
save to the full disk ``FULL`` whose ``wait()`` raises and is handled, a save to ``OTHER`` that must work, then
another asynchronous save to ``FULL`` that nobody waits for before the script ends (the exit must say it in one
line). ``phalanx run --elastic -n 2 checkpoint_async.py elastic OUT``: the worker started as rank 0 is killed
half-way through an asynchronous save's write (by its writer process, tests/workers/writer_hooks.py); the survivor
trains on and then saves to the same path again. ``phalanx run --elastic -n 3 checkpoint_async.py elastic OUT 2``:
the same with the worker started as rank 2 killed, so that two survivors regroup and the abandoned save's rank 0
is one of them.
"""
from __future__ import annotations

import json
import os
import sys

import torch
import torch.nn.functional as F


def _net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Tanh(), torch.nn.Linear(256, 8))


def full_disk(full: str, other: str, out: str) -> None:
    import phalanx as px
    px.init()
    model, opt = px.wrap(net := _net(), torch.optim.AdamW(net.parameters()))
    F.mse_loss(model(torch.randn(4, 64)), torch.zeros(4, 8)).backward()
    opt.step()
    handle = px.save_checkpoint(os.path.join(full, "ckpt"), model, opt, step=1, blocking=False)
    try:
        handle.wait()
        raised = ""
    except px.CheckpointError as err:  # the caller handles it: saves elsewhere from now on
        raised = str(err)
    px.save_checkpoint(other, model, opt, step=2)  # another disk: must not raise the error handled above
    result = {"raised": raised, "other_step": px.read_checkpoint(other)["step"]}
    with open(os.path.join(out, f"rank{px.rank()}.json"), "w") as f:
        json.dump(result, f)
    px.save_checkpoint(os.path.join(full, "ckpt"), model, opt, step=3, blocking=False)  # fails; nobody waits


def elastic(out: str, victim: str = "0") -> None:
    import phalanx as px
    import phalanx.checkpoint.saver as saver
    from phalanx.checkpoint.writer import WRITERS
    from phalanx.group.orphan import launcher_gone
    from support.wait import until
    from workers.writer_hooks import CutWriter
    me = os.environ.get("PHALANX_ELASTIC_ID", "0")
    held = os.path.join(out, f"held-{me}.json")
    px.init()
    model, opt = px.wrap(net := _net(), torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9))
    data = torch.utils.data.TensorDataset(torch.randn(64, 64, generator=torch.Generator().manual_seed(1)),
                                          torch.zeros(64, 8))
    loader = px.shard(data, batch_size=4, seed=0)
    state = px.elastic.State(model, opt, loader, commit_every=2)
    ckpt = os.path.join(out, "ckpt")
    plain_writer = saver._writer
    if victim != "0":
        # rank 0 of the cut save survives: it learns that its write ended (its writer killed at the regroup) and posts
        # "not written" only once the next generation has formed (an event: the group's generation), where a late
        # post lands whenever the regroup is quicker than the writer's end
        from phalanx.checkpoint import handle as handle_module
        real_abandon = handle_module._abandon

        def abandon_late(tmp, key, err=None, *rest):  # noqa: ANN001, ANN002, ANN202
            if err is not None:
                until(lambda: px.current_group().generation >= 1, timeout=120, what="the next generation")
            real_abandon(tmp, key, err, *rest)
        handle_module._abandon = abandon_late

    steps = 0
    for epoch in state.epochs(2):
        with state:
            loader.set_epoch(epoch)
            for x, y in loader:
                steps += 1
                if steps == 3 and not state.history:
                    # the test's hook into DCP's writer: the worker started as rank 0 dies half-way through its write
                    # (its writer process writes a part, then kills it); the other's writer holds half-way, so that
                    # the regroup comes while its write is in flight
                    saver._writer = lambda tmp: CutWriter(tmp, kill_worker=me == victim,
                                                          held=None if me == victim else held)
                    px.save_checkpoint(ckpt, model, opt, step=steps, blocking=False)
                    saver._writer = plain_writer
                    # (a writer process imports torch first: minutes on a loaded 2-core machine)
                    until(lambda: os.path.exists(held), timeout=180, what="the writer holding the write half-way")
                opt.zero_grad()
                F.mse_loss(model(x), y).backward()
                opt.step()
    def left() -> list[str]:
        return sorted(n for n in os.listdir(out) if not n.startswith("held-"))

    cut = left()  # the survivor: what the cut save left
    writer = json.load(open(held))["writer"]  # the regroup ended the writer that held the old generation's write
    try:  # the next save of that path (with two survivors, its key in the new generation is the cut save's own)
        px.save_checkpoint(ckpt, model, opt, step=99)
        raised = ""
    except px.CheckpointError as err:
        raised = str(err)
    result = {"raised": raised, "left_after_training": cut, "left_after_save": left(),
              "history": [h["left"] for h in state.history], "held_writer_gone": launcher_gone(writer)}
    result["writer_kept"] = WRITERS.of(px.current_group()).value is not None  # (the next save starts another)
    with open(os.path.join(out, f"worker{me}.json"), "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    {"full-disk": full_disk, "elastic": elastic}[sys.argv[1]](*sys.argv[2:])
