"""Worker for tests/strategies/test_running_stats.py: BatchNorm statistics under periodic rules, 2 real gloo processes.

Each rank feeds data of its own mean, so the replicas' running statistics differ between syncs. Every
step records each rank's buffers after backward (what the forward just set) and after ``optimizer.step()``
(where a sync may have averaged them); the test checks the second against the one-process oracle built
from the first: the mean of both ranks' at a sync, this rank's own otherwise.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import phalanx as px

STEPS, CONSTANT = 9, 1000  # CONSTANT: floats in a buffer no step changes (a mask): never sent


class Net(nn.Module):
    def __init__(self, constant: bool) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 2))
        if constant:
            self.register_buffer("mask", torch.ones(CONSTANT))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def stats(model: nn.Module) -> list[torch.Tensor]:
    bn = px.unwrap(model).body[1]
    return [bn.running_mean.clone(), bn.running_var.clone()]


def gathered(tensors: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, tensors)
    return out


def one(make: str, constant: bool) -> dict[str, Any]:
    strategy = {"local-sgd": lambda: px.LocalSGD(every=3), "diloco": lambda: px.DiLoCo(every=3),
                "easgd": lambda: px.EASGD(every=3),
                "streaming": lambda: px.StreamingDiLoCo(every=4, fragments=2, overlap=1)}[make]()
    torch.manual_seed(0)
    net = Net(constant)
    model, opt = px.wrap(net, torch.optim.SGD(net.parameters(), lr=0.05), strategy=strategy)
    at_attach = px.strategy_of(opt).bytes_sent  # the broadcast of rank 0's state, the mask included
    gen = torch.Generator().manual_seed(10 + px.rank())
    rows = []
    for step in range(1, STEPS + 1):
        x = torch.randn(16, 4, generator=gen) + 3.0 * px.rank()  # each rank's data has its own mean
        y = torch.randint(0, 2, (16,), generator=gen)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        before = gathered(stats(model))
        opt.step()
        rows.append({"step": step, "before": before, "after": stats(model)})
    s = px.strategy_of(opt)
    sent = s.bytes_sent - at_attach
    fragment_of_bn = None
    if make == "streaming":
        bn = px.unwrap(model).body[1]
        fragment_of_bn = [f.index for f in s.fragments if any(b is bn.running_mean for b in f.running_stats.buffers)]
        fragment_of_bn = [(i, s.fragments[i].offset) for i in fragment_of_bn]
    s.finish()
    return {"rows": rows, "bytes": sent, "final": gathered(stats(model)), "fragment_of_bn": fragment_of_bn}


def run() -> dict[str, Any]:
    px.init()
    out = {make: one(make, constant=True) for make in ("local-sgd", "diloco", "easgd", "streaming")}
    out["local-sgd-without-constant"] = one("local-sgd", constant=False)
    return out
