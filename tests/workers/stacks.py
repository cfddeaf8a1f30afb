"""A job that gets stuck on purpose: rank 0 spins in a Python loop, rank 1 waits for it in the gradients' all-reduce.

    phalanx run -n 2 tests/workers/stacks.py MARKS [WARM_S]

Each rank trains a few steps (so the launcher's watchdog has seen the group step; for at least WARM_S seconds
when given, so that it has also measured a step time and its stall bound is its floor, not its cap), writes
``MARKS/pid-<rank>`` and then gets stuck; rank 0 spins until ``MARKS/release`` exists, then
both finish the step and exit 0. The lines marked ``# SPIN`` and ``# BLOCKED`` are the ones
the stacks must name.
"""
import os
import sys
import time

import torch

import phalanx as px

marks = sys.argv[1]
warm_s = float(sys.argv[2]) if len(sys.argv) > 2 else 0.0
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


started, done = time.monotonic(), 0
while True:  # 3 steps at least, and steps for warm_s (the ranks agree when to stop: a sum)
    step()
    done += 1
    more = torch.tensor([float(done < 3 or time.monotonic() - started < warm_s)])
    px.Comm().all_reduce_([more], op="sum")
    if not more.item():
        break
with open(os.path.join(marks, f"pid-{px.rank()}.tmp"), "w") as f:
    f.write(str(os.getpid()))
os.replace(os.path.join(marks, f"pid-{px.rank()}.tmp"), os.path.join(marks, f"pid-{px.rank()}"))
if px.rank() == 0:
    spin(os.path.join(marks, "release"))
step()
