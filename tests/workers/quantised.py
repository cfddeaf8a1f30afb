"""Workers for tests/strategies/test_quantised_allreduce.py: AllReduce with px.Quantize, sent bucket by bucket.

Every rank trains the same MLP on its own batch. The test replays each step in one process: each rank's
gradient, cut into the same buckets (``plan_buckets``), quantised, and the messages averaged in rank order
(``Quantize.sum_messages``), so the oracle is the exchange's own arithmetic on gradients computed elsewhere.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import phalanx as px

IN, WIDTH, OUT, BATCH, STEPS, LR = 32, 64, 4, 8, 3, 0.1
BUCKET_MB = 8e-3  # ~8 kB: one bucket per weight matrix of WIDTH x WIDTH floats (16 kB) and smaller ones beside


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(IN, WIDTH), nn.Tanh(), nn.Linear(WIDTH, WIDTH), nn.Tanh(),
                         nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, OUT))


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(BATCH, IN, generator=gen), torch.randn(BATCH, OUT, generator=gen)


def compressor() -> px.Quantize:
    return px.Quantize(4, block=64, error_feedback=True)


def overlapped() -> dict[str, Any]:
    """Per step: the weights before it, the averaged gradients, and the order of sends and backward's last grad."""
    px.init()
    torch.set_num_threads(1)
    net = mlp()
    strategy = px.AllReduce(compression=compressor(), bucket_mb=BUCKET_MB)
    model, opt = px.wrap(net, torch.optim.SGD(net.parameters(), lr=LR), strategy=strategy)
    events: list[str] = []
    start_mean = strategy.compression.start_mean

    def recorded(*args: Any, **kwargs: Any) -> Any:
        events.append("send")
        return start_mean(*args, **kwargs)

    strategy.compression.start_mean = recorded  # type: ignore[method-assign]
    first = next(iter(net.parameters()))  # the first layer's weight: backward reaches it last
    first.register_post_accumulate_grad_hook(lambda _: events.append("last grad"))
    steps = []
    for step in range(STEPS):
        x, y = batch(px.rank(), step)
        weights = [p.detach().clone() for p in net.parameters()]
        events.clear()
        sent_before = strategy.comm.stats.bytes_sent
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        steps.append({"weights": weights, "grads": [p.grad.clone() for p in net.parameters()],
                      "events": list(events), "bytes": strategy.comm.stats.bytes_sent - sent_before})
        opt.step()
    index = {id(p): i for i, p in enumerate(net.parameters())}
    buckets = [[index[id(q)] for q in b.params] for b in strategy._overlap.buckets]  # in the bucket's order
    return {"steps": steps, "buckets": buckets}
