"""Worker for tests/strategies/test_custom_rule.py: the docs' AverageEvery rule, extracted verbatim, on real ranks."""
from __future__ import annotations

import os
from typing import Any

import torch
import torch.nn.functional as F

import phalanx as px
from phalanx.step.protocols import replicas_agree

MARKER = "<!-- custom-rule-average -->"


def doc_rule() -> type:
    """The AverageEvery class from docs/strategies.md, exactly as printed there."""
    here = os.path.dirname(os.path.abspath(__file__))
    text = open(os.path.join(here, "..", "..", "docs", "strategies.md")).read()
    code = text.split(MARKER)[1].split("```python")[1].split("```")[0]
    scope: dict[str, Any] = {}
    exec(compile(code, "docs/strategies.md", "exec"), scope)
    return scope["AverageEvery"]


def net(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))


def data(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    return torch.randn(n, 6, generator=gen), torch.randint(0, 3, (n,), generator=gen)


def average_every(k: int, steps: int, batch: int) -> dict[str, Any]:
    """Train ``steps`` steps of ``batch`` samples per rank (rank r takes slice r of each global batch), then finish."""
    px.init()
    rank, world = px.rank(), px.world_size()
    model = net(seed=rank)  # the seeds differ: attach broadcasts rank 0's weights
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model, opt = px.wrap(model, opt, strategy=doc_rule()(k))
    x, y = data(steps * batch * world)
    for s in range(steps):
        lo = (s * world + rank) * batch
        opt.zero_grad()
        F.cross_entropy(model(x[lo:lo + batch]), y[lo:lo + batch]).backward()
        opt.step()
    strategy = px.strategy_of(opt)
    strategy.finish()
    return {"params": [p.detach().clone() for p in px.unwrap(model).parameters()], "steps": strategy.steps,
            "agree": [replicas_agree(strategy, s) for s in range(1, steps + 1)]}
