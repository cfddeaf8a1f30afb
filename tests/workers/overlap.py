"""Worker functions for tests/strategies/test_overlap.py: AllReduce's overlapped bucketed average (no DDP wrapper).

The path is the one ``phalanx run --elastic`` takes (``PHALANX_ELASTIC_ID`` set when the
strategy attaches); the oracle, a plain single-process loop with twice the batch, runs in
the test itself from the same data and the same loop (:func:`train`).
"""
from __future__ import annotations

from contextlib import nullcontext
import time
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import phalanx as px
from support.procs import kill_at
from phalanx.strategies.allreduce import REBUILT

IN, CLASSES, B = 6, 3, 4
BUCKET_MB = 0.0003  # ~300 bytes: several buckets for this small net, so their order matters


class Net(nn.Module):
    """An MLP with a branch that only some batches take, and a parameter no batch uses."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(IN, 16), nn.Linear(16, 16)
        self.never = nn.Parameter(torch.ones(5))  # between layers: its bucket never fills by itself
        self.branch = nn.Linear(IN, CLASSES)
        self.head = nn.Linear(16, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.head(torch.tanh(self.b(torch.tanh(self.a(x)))))
        rare = (x[:, 0] > 1.0).float().unsqueeze(1)  # about 1 sample in 6: many batches have none
        if bool(rare.any()):  # data-dependent: on some ranks and steps `branch` gets no gradient at all
            out = out + rare * self.branch(x)
        return out


def dataset(n: int) -> torch.utils.data.TensorDataset:
    gen = torch.Generator().manual_seed(99)
    return torch.utils.data.TensorDataset(torch.randn(n, IN, generator=gen),
                                          torch.randint(0, CLASSES, (n,), generator=gen))


def net(seed: int) -> Net:
    torch.manual_seed(seed)
    return Net()


def train(model: nn.Module, opt: torch.optim.Optimizer, loader: Any, epochs: int, *, accumulate: int = 1,
          no_sync: Any = None, on_step: Any = lambda: None) -> None:
    """SGD with clipping; ``accumulate`` micro-batches per step, all but the last under ``no_sync(model)``.

    Batches are drawn one at a time: the loader sets each one's batch weight as it yields it.
    """
    for epoch in range(epochs):
        loader.set_epoch(epoch)
        batches = iter(loader)
        for k, (x, y) in enumerate(batches):
            if k % accumulate == 0:
                opt.zero_grad()
            last = k % accumulate == accumulate - 1
            with (no_sync(model) if no_sync is not None and not last else nullcontext()):
                F.cross_entropy(model(x), y).backward()
            if last:
                torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=0.3)  # sees the average: clips
                opt.step()
                on_step()


def flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _wrapped(seed: int) -> tuple[nn.Module, torch.optim.Optimizer, px.AllReduce]:
    model = net(seed)
    strategy = px.AllReduce(bucket_mb=BUCKET_MB)
    rebuilt = REBUILT.of(px.current_group())
    rebuilt.value = "tests"  # what `phalanx run --elastic` records for the group: no DDP wrapper, the overlapped hooks
    try:
        model, opt = px.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), strategy=strategy)
    finally:
        rebuilt.value = None
    return model, opt, strategy


def everything(n_plain: int, n_accumulate: int, epochs: int) -> dict[str, Any]:
    """Plain steps on an uneven dataset, then no_sync accumulation; replicas compared after every step."""
    px.init()
    out: dict[str, Any] = {}
    comm = px.Comm()

    model, opt, strategy = _wrapped(seed=10 + px.rank())  # seeds differ: wrap broadcasts rank 0's weights
    out["ddp"] = isinstance(model, DistributedDataParallel)
    out["buckets"] = len(strategy._overlap.buckets) if strategy._overlap is not None else 0
    agree: list[bool] = []
    check = lambda: agree.append(all(torch.equal(flat(model), t) for t in comm.all_gather(flat(model))))  # noqa: E731
    train(model, opt, px.shard(dataset(n_plain), batch_size=B, shuffle=True, seed=3), epochs, on_step=check)
    out["plain"], out["plain_agree"] = flat(model), agree
    out["never_grad"] = model.never.grad  # no rank reached it: None, as in one process
    out["bytes_per_step"] = strategy.bytes_per_step

    model, opt, strategy = _wrapped(seed=20 + px.rank())
    agree = []
    check = lambda: agree.append(all(torch.equal(flat(model), t) for t in comm.all_gather(flat(model))))  # noqa: E731
    train(model, opt, px.shard(dataset(n_accumulate), batch_size=B, shuffle=True, seed=4), epochs,
          accumulate=2, no_sync=px.no_sync, on_step=check)
    out["accumulate"], out["accumulate_agree"] = flat(model), agree
    out["accumulate_steps"] = strategy.steps
    return out


def lost_worker(kill_step: int = 3) -> dict[str, Any]:
    """Rank 1 dies before its backward at ``kill_step``; rank 0's overlapped buckets must name it."""
    px.init()
    model, opt, _ = _wrapped(seed=0)
    loader = px.shard(dataset(48), batch_size=B)
    steps = [0]

    def step_done() -> None:
        steps[0] += 1
        kill_at(kill_step, rank=1, now=steps[0], code=3)

    started = time.monotonic()
    try:
        train(model, opt, loader, epochs=3, on_step=step_done)
    except Exception as err:  # noqa: BLE001 - reporting whatever surfaced is the point
        return {"type": type(err).__name__, "message": str(err)[:2000], "seconds": time.monotonic() - started}
    return {"type": None}
