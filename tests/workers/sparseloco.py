"""Workers for tests/strategies/test_sparseloco.py: px.SparseLoCo inside DiLoCo and StreamingDiLoCo (2 gloo ranks).

Every rank trains the same small MLP with AdamW on its own batches (``batch(rank, step)``); the test replays the
whole run in one process with the paper's algorithm written out there. Each rule also checkpoints mid-round,
resumes in fresh objects, and reports its residuals before the save and after the load.
"""
from __future__ import annotations

import os
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

import phalanx as px

IN, WIDTH, OUT, BATCH = 8, 24, 3, 6
EVERY, STEPS, CUT = 3, 12, 7  # four outer rounds; the checkpoint is taken mid-round
TOPK, CHUNK, DECAY, LR = 4, 64, 0.9, 1e-2


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(IN, WIDTH), nn.Tanh(), nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, OUT))


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(BATCH, IN, generator=gen), torch.randn(BATCH, OUT, generator=gen)


def compressor() -> px.SparseLoCo:
    return px.SparseLoCo(TOPK, chunk=CHUNK, decay=DECAY)


RULES: dict[str, Callable[[], px.Strategy]] = {
    "diloco": lambda: px.DiLoCo(every=EVERY, compression=compressor()),
    "streaming": lambda: px.StreamingDiLoCo(every=EVERY, fragments=2, overlap=0, quantize=compressor()),
}


def build(rule: str) -> tuple[nn.Module, torch.optim.Optimizer, px.Strategy]:
    net = mlp()
    strategy = RULES[rule]()
    model, opt = px.wrap(net, torch.optim.AdamW(net.parameters(), lr=LR), strategy=strategy)
    return model, opt, strategy


def steps(model: nn.Module, opt: torch.optim.Optimizer, first: int, last: int,
          record: list | None = None) -> None:
    for step in range(first, last + 1):
        x, y = batch(px.rank(), step)
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        opt.step()
        if record is not None:
            record.append([p.detach().clone() for p in px.unwrap(model).parameters()])


def residuals(strategy: Any) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in strategy.compression.residuals.items()}


def layout(strategy: Any) -> list[tuple[list[int], int]]:
    """Per fragment (DiLoCo: one): the indices of its parameters and its schedule offset."""
    if not isinstance(strategy, px.StreamingDiLoCo):
        return [(list(range(len(strategy.params))), 0)]
    index = {id(p): i for i, p in enumerate(strategy.params)}
    return [([index[id(p)] for p in f.params], f.offset) for f in strategy.fragments]


def exchanges(ckpt_dir: str) -> dict[str, Any]:
    px.init()
    torch.set_num_threads(1)
    out: dict[str, Any] = {}
    for rule in RULES:
        model, opt, strategy = build(rule)
        start = strategy.bytes_sent  # the initial broadcast of rank 0's weights
        weights: list = []
        steps(model, opt, 1, STEPS, weights)
        out[rule] = {"weights": weights, "layout": layout(strategy), "residuals": residuals(strategy),
                     "bytes_sent": strategy.bytes_sent - start,
                     "message_bytes": [strategy.compression.message_bytes(sum(strategy.params[i].numel()
                                                                               for i in idx))
                                       for idx, _ in layout(strategy)]}
        # the checkpoint round trip: cut mid-round, save (collective), resume in fresh objects, go on
        model, opt, strategy = build(rule)
        steps(model, opt, 1, CUT)
        path = os.path.join(ckpt_dir, f"{rule}.ckpt")
        saved = residuals(strategy)
        px.save_checkpoint(path, model, opt, step=CUT)
        px.barrier()
        model, opt, strategy = build(rule)
        px.load_checkpoint(path, model, opt)
        loaded = residuals(strategy)
        resumed: list = []
        steps(model, opt, CUT + 1, STEPS, resumed)
        out[rule]["resume"] = {"saved": saved, "loaded": loaded, "final": resumed[-1]}
    return out
