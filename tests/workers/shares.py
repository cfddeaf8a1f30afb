"""Worker functions for tests/data/test_shares.py: parameter averaging weighted by each replica's samples.

Plain SGD (no momentum), so LocalSGD(every=1) is AllReduce and both are one process on the global batch,
also on a short last global batch (split 3 / 2) and on one with an empty part (1 / 0). The oracle, one
process with twice the batch, runs in the same worker.
"""
from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

import phalanx as px
from support.loop import classification, mlp

IN, CLASSES, B = 5, 3, 4


def dataset(n: int) -> torch.utils.data.TensorDataset:
    return classification(n, IN, CLASSES, seed=8)


def net() -> nn.Module:
    return mlp(IN, 8, CLASSES, seed=2)


def train(strategy: px.Strategy | None, n: int) -> torch.Tensor:
    model = net()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    if strategy is None:
        loader = px.shard(dataset(n), batch_size=2 * B, seed=1, rank=0, world_size=1)
    else:
        model, opt = px.wrap(model, opt, strategy=strategy)
        loader = px.shard(dataset(n), batch_size=B, seed=1)
    for epoch in range(2):
        loader.set_epoch(epoch)
        for x, y in loader:
            opt.zero_grad()
            # a sum over the part, divided by its size: an empty part gives a zero loss, not NaN
            (F.cross_entropy(model(x), y, reduction="sum") / max(1, len(x))).backward()
            opt.step()
    if strategy is not None:
        px.strategy_of(opt).finish()
    return torch.cat([p.detach().reshape(-1) for p in px.unwrap(model).parameters()])


STRATEGIES: dict[str, Callable[[], px.Strategy]] = {
    "allreduce": px.AllReduce,
    "local-sgd": lambda: px.LocalSGD(every=1),
    "diloco": lambda: px.DiLoCo(every=1, outer_lr=1.0, outer_momentum=0.0),
    "local-sgd-2": lambda: px.LocalSGD(every=2),
}


def shares(sizes: list[int], names: list[str]) -> dict[str, Any]:
    import warnings
    px.init()
    torch.set_num_threads(1)
    out: dict[str, Any] = {}
    for n in sizes:
        out[f"oracle {n}"] = train(None, n)
        for name in names:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # LocalSGD(every=1) warns that AllReduce is the same rule
                out[f"{name} {n}"] = train(STRATEGIES[name](), n)
    return out
