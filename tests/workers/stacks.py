"""A job that gets stuck on purpose: rank 0 spins in a Python loop, rank 1 waits for it in the gradients' all-reduce.

    phalanx run -n 2 tests/workers/stacks.py MARKS

Each rank trains a few steps (so the launcher's watchdog has seen the group step), writes
``MARKS/pid-<rank>`` and then gets stuck; rank 0 spins until ``MARKS/release`` exists, then
both finish the step and exit 0. The lines marked ``# SPIN`` and ``# BLOCKED`` are the ones
the stacks must name.
"""
import os
import sys

import torch

import phalanx as px

marks = sys.argv[1]
px.init()
net = torch.nn.Linear(4, 1)
model, opt = px.wrap(net, torch.optim.SGD(net.parameters(), lr=0.01), strategy=px.AllReduce())
x = torch.ones(8, 4)


def step() -> None:
    opt.zero_grad()
    model(x).sum().backward()  # BLOCKED: rank 1 waits here in the all-reduce of the gradients
    opt.step()


def spin(release: str) -> None:
    while not os.path.exists(release):  # SPIN: rank 0 spins here, holding up the step
        pass


for _ in range(3):
    step()
with open(os.path.join(marks, f"pid-{px.rank()}.tmp"), "w") as f:
    f.write(str(os.getpid()))
os.replace(os.path.join(marks, f"pid-{px.rank()}.tmp"), os.path.join(marks, f"pid-{px.rank()}"))
if px.rank() == 0:
    spin(os.path.join(marks, "release"))
step()
