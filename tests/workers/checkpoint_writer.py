"""Script for tests/checkpoint/test_checkpoint_writer.py: asynchronous saves whose writer process, then whose worker,
the test kills with SIGKILL half-way through the write.

``python checkpoint_writer.py OUT`` (a plain process): saves ``OUT/step-1`` (blocking); starts ``OUT/step-2``
asynchronously with a writer that holds half-way (``OUT/held-2.json`` names the writer process: the test kills it)
and trains on; its ``wait()`` must raise; then saves ``OUT/step-3`` asynchronously (a new writer process) and writes
what it saw to ``OUT/result.json``; then starts ``OUT/step-4`` held the same way (``OUT/held-4.json``) and trains
until the test kills this process.
"""
from __future__ import annotations

import json
import os
import sys
import threading

import torch
import torch.nn.functional as F


def main(out: str) -> None:
    import phalanx as px
    import phalanx.checkpoint.saver as saver
    from phalanx.checkpoint.writer import WRITERS
    from workers.writer_hooks import CutWriter
    px.init()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 4))
    model, opt = px.wrap(model, torch.optim.AdamW(model.parameters(), lr=0.01))

    def step() -> None:
        opt.zero_grad()
        F.mse_loss(model(torch.randn(8, 32)), torch.zeros(8, 4)).backward()
        opt.step()

    def held(n: int) -> px.checkpoint.SaveHandle:
        plain = saver._writer
        saver._writer = lambda tmp: CutWriter(tmp, held=os.path.join(out, f"held-{n}.json"))  # the test's hook
        try:
            return px.save_checkpoint(os.path.join(out, f"step-{n}"), model, opt, step=n, blocking=False)
        finally:
            saver._writer = plain

    step()
    px.save_checkpoint(os.path.join(out, "step-1"), model, opt, step=1)
    torch.save([p.detach().clone() for p in model.parameters()], os.path.join(out, "weights-1.pt"))
    handle = held(2)
    for _ in range(3):
        step()  # training goes on while the writer holds (until the test kills it)
    try:
        handle.wait()
        raised = None
    except px.CheckpointError as err:
        raised = [type(err).__name__, str(err)]
    result = {"raised": raised, "after_kill": sorted(os.listdir(out)),
              "latest": px.latest_checkpoint(out), "done": handle.done()}
    handle = px.save_checkpoint(os.path.join(out, "step-3"), model, opt, step=3, blocking=False)
    handle.wait()
    result["step-3"] = px.read_checkpoint(os.path.join(out, "step-3"))["step"]
    result["writer-3"] = WRITERS.of(px.current_group()).value.pid
    with open(os.path.join(out, "result.tmp"), "w") as f:
        json.dump(result, f)
    os.replace(os.path.join(out, "result.tmp"), os.path.join(out, "result.json"))
    held(4)
    step()
    threading.Event().wait()  # the test kills this process while step-4 is being written


if __name__ == "__main__":
    main(sys.argv[1])
