"""Worker functions for tests/strategies/test_accumulation.py: gradient accumulation over micro-batches of unequal size.

Each worker trains with ``px.shard`` on a dataset whose last global batch splits unevenly (3 / 2), accumulating
two micro-batches per step (the first under ``px.no_sync``). The oracle, one process on the same samples with
twice the batch, runs in the same worker (no collectives).
"""
from __future__ import annotations

from contextlib import nullcontext
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

import phalanx as px
from support.loop import classification, mlp

IN, CLASSES, B, N, EPOCHS = 5, 3, 4, 45, 2   # 45 = 5 global batches of 8, then 5: split 3 / 2


def dataset() -> torch.utils.data.TensorDataset:
    return classification(N, IN, CLASSES, seed=5)


def net() -> nn.Module:
    return mlp(IN, 8, CLASSES, seed=3)


def train(model: nn.Module, opt: torch.optim.Optimizer, loader: Any, no_sync: Callable[[Any], Any] | None) -> None:
    """Two micro-batches per step; each one's mean loss is halved, as nanoGPT divides by its accumulation steps."""
    for epoch in range(EPOCHS):
        loader.set_epoch(epoch)
        for k, (x, y) in enumerate(loader):
            if k % 2 == 0:
                opt.zero_grad()
                with (no_sync(model) if no_sync is not None else nullcontext()):
                    (F.cross_entropy(model(x), y) / 2).backward()
            else:
                (F.cross_entropy(model(x), y) / 2).backward()
                opt.step()


def flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in px.unwrap(model).parameters()])


STRATEGIES: dict[str, Callable[[], px.Strategy]] = {
    "allreduce": px.AllReduce,                                          # DDP's reducer and comm hook
    "topk1": lambda: px.AllReduce(compression=px.TopK(1.0)),           # the compressed average in after_backward
    "local-warmup": lambda: px.LocalSGD(every=4, warmup_steps=10**6),  # gradient averaging in after_backward
}


def uneven(names: list[str]) -> dict[str, Any]:
    import warnings
    px.init()
    torch.set_num_threads(1)
    model = net()
    opt = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
    train(model, opt, px.shard(dataset(), batch_size=2 * B, seed=1, rank=0, world_size=1), None)
    out: dict[str, Any] = {"oracle": flat(model)}
    for name in names:
        model = net()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # TopK(1.0) warns that it sends more than dense; here it is exact
            model, opt = px.wrap(model, torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9),
                                 strategy=STRATEGIES[name]())
        train(model, opt, px.shard(dataset(), batch_size=B, seed=1), px.no_sync)
        px.strategy_of(opt).finish()
        out[name] = flat(model)
    return out
