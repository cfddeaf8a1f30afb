"""A process that saves one checkpoint path over and over (tests/checkpoint/test_checkpoint_integrity.py).

Save ``i`` holds weights, AdamW moments, ``step`` and ``extra`` that all encode ``i``, so a
reader can tell whether what it loaded came from one save. It prints ``saved <i>`` after
each save (the test waits for the first line) and stops when its stdin is closed, or, given
``STOP``, once that file exists (a process forked from the fork server has no stdin pipe).

Usage: ``python overlapping_saver.py PATH [STOP]``
"""
from __future__ import annotations

import os
import select
import sys

import torch

import phalanx as px

WIDTH = 128  # ~0.2 MB of tensors: what mixes is the order of files, not their size


def model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    net = torch.nn.Sequential(torch.nn.Linear(WIDTH, WIDTH), torch.nn.Linear(WIDTH, 4))
    return net, torch.optim.AdamW(net.parameters(), lr=0.1)


def encode(net: torch.nn.Module, opt: torch.optim.Optimizer, i: int) -> None:
    """Every tensor of the model and of the optimizer's state set to ``i``."""
    with torch.no_grad():
        for p in net.parameters():
            p.fill_(i)
            for v in opt.state[p].values():
                v.fill_(i)


def main(path: str, stop: str | None = None) -> None:
    torch.set_num_threads(1)  # tiny tensors: more threads only contend with the test's loads
    net, opt = model()
    net(torch.ones(1, WIDTH)).sum().backward()
    opt.step()  # the optimizer holds state (exp_avg, exp_avg_sq, step) for every parameter
    i = 0
    while True:
        i += 1
        encode(net, opt, i)
        px.save_checkpoint(path, net, opt, step=i, extra={"i": i})
        print(f"saved {i}", flush=True)
        if stop is not None:
            if os.path.exists(stop):  # the test is done
                return
            continue
        ready, _, _ = select.select([sys.stdin], [], [], 0)
        if ready and not os.read(sys.stdin.fileno(), 1):  # stdin closed: the test is done
            return


if __name__ == "__main__":
    main(*sys.argv[1:3])
