"""A user's own loop that a preemption stops and ``--resume-from auto`` continues (run by tests/step/test_preempt.py).

    phalanx run -n 2 --checkpoint-dir CKPT [--resume-from auto] preempt.py OUT [WAIT_AT] [--hang-before-save]

Rank 0 writes ``OUT.reached`` after step WAIT_AT and waits for the signal there (the test sends it
when it sees the file), so the stop step is deterministic without sleeps: rank 0 hears it at
boundary WAIT_AT, rank 1 during step WAIT_AT+1, so every worker stops after WAIT_AT+2.
"""
from __future__ import annotations

import argparse
import os
import signal

import torch
import torch.nn.functional as F

import phalanx as px
from phalanx.step import preempt

EPOCHS, N, BATCH = 2, 64, 4


def data() -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(0)
    return torch.utils.data.TensorDataset(torch.randn(N, 8, generator=g), torch.randint(0, 3, (N,), generator=g))


def make_model() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("wait_at", nargs="?", type=int, default=-1)
    p.add_argument("--hang-before-save", action="store_true", help="rank 1 never saves (it hangs once stopped)")
    a = p.parse_args()
    px.init()
    torch.manual_seed(1)
    net = make_model()
    model, opt = px.wrap(net, torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9))
    loader = px.shard(data(), batch_size=BATCH, shuffle=True, seed=0)
    step = 0
    if px.resume_from() is not None:
        step = int(px.load_checkpoint(px.resume_from(), model, opt, loader=loader)["step"])
    for epoch in range(loader.sampler.epoch, EPOCHS):
        loader.set_epoch(epoch)
        for x, y in loader:
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
            step += 1
            if step == a.wait_at and px.rank() == 0:
                with open(a.out + ".reached", "w") as f:
                    f.write(str(step))
                assert preempt.of().heard.wait(120), "no signal came"
            if px.preempted():
                if a.hang_before_save and px.rank() == 1:
                    while True:  # until the launcher's grace runs out and it kills this worker
                        signal.pause()
                px.save_checkpoint(os.path.join(px.step.preempt.checkpoint_dir(), f"step-{step}.pt"), model, opt,
                                   loader=loader, step=step)
                raise SystemExit(px.PREEMPTED_EXIT)
    px.save(model, a.out)
    px.shutdown()


if __name__ == "__main__":
    main()
