"""Worker functions for tests/strategies/test_unused.py: parameters that get no gradient on some ranks, or on none.

The model has a branch that only some samples take (on rank 0's half at even steps, nowhere at odd steps) and a
parameter nothing uses. SGD with momentum and weight decay moves a parameter whose ``.grad`` is zeros but skips
one whose ``.grad`` is None, so a zero filled in where one process has None shows in the weights. The oracle,
one process on the global batch, runs in the same worker (no collectives).
"""
from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

import phalanx as px

IN, CLASSES, GLOBAL, STEPS = 5, 3, 8, 6


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Linear(IN, CLASSES)
        self.never = nn.Parameter(torch.ones(4))  # no sample uses it: grad None everywhere, as in one process
        self.branch = nn.Linear(IN, CLASSES)      # only samples with x[:, 0] > 1 use it

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.body(x)
        rare = (x[:, 0] > 1.0).float().unsqueeze(1)
        if bool(rare.any()):
            out = out + rare * self.branch(x)
        return out


def data() -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(3)
    out = []
    for step in range(STEPS):
        x = torch.randn(GLOBAL, IN, generator=gen).clamp(-0.9, 0.9)
        if step % 2 == 0:
            x[1, 0] = 2.0  # one rare sample, in rank 0's half
        out.append((x, torch.randint(0, CLASSES, (GLOBAL,), generator=gen)))
    return out


def sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.3, momentum=0.9, weight_decay=0.1)


def train(strategy: px.Strategy | None) -> dict[str, Any]:
    model = Net()
    opt = sgd(model.parameters())
    if strategy is not None:
        model, opt = px.wrap(model, opt, strategy=strategy)
    half = GLOBAL // px.world_size()
    for x, y in data():
        if strategy is not None:
            x, y = x[px.rank() * half:(px.rank() + 1) * half], y[px.rank() * half:(px.rank() + 1) * half]
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    if strategy is not None:
        px.strategy_of(opt).finish()
    net = px.unwrap(model)
    return {"params": {n: p.detach().clone() for n, p in net.named_parameters()},
            "never_grad": net.never.grad, "branch_grad_last": net.branch.weight.grad}


STRATEGIES: dict[str, Callable[[], px.Strategy]] = {
    "allreduce": px.AllReduce,
    "topk1": lambda: px.AllReduce(compression=px.TopK(1.0)),
    "powersgd": lambda: px.AllReduce(compression=px.PowerSGD(rank=1)),
    "int8": lambda: px.AllReduce(compression=px.Quantize(8, block=16)),
    "local-warmup": lambda: px.LocalSGD(every=4, warmup_steps=10**6),
    "ps-sync": lambda: px.ParameterServer(sync=True, servers="colocated"),
    "downpour": lambda: px.Downpour(servers="colocated"),
}


def unused(names: list[str]) -> dict[str, Any]:
    import warnings
    px.init()
    torch.set_num_threads(1)
    out: dict[str, Any] = {"oracle": train(None)}
    for name in names:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # TopK(1.0) warns that it sends more than dense
            try:
                out[name] = train(STRATEGIES[name]())
            except Exception as err:  # noqa: BLE001 - reported to the test, which names it
                out[name] = {"error": f"{type(err).__name__}: {str(err)[:300]}"}
                break  # the group may be unusable after a failed collective
    return out
