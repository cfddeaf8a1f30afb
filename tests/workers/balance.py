"""Worker functions for tests/data/test_balance.py: px.shard(balance="speed") with injected speeds.

The speeds come from an object passed to the loader (no sleeps): rank 0 reports 1 s per sample
and rank 1 3 s, then both 1 s, then 2 s and 1 s, so the split changes mid-epoch. The oracle,
one process with the global batch, runs in the same worker.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import phalanx as px

N, IN, CLASSES, B, EVERY = 44, 5, 3, 4, 2
SPEEDS = [(1.0, 3.0), (1.0, 1.0), (2.0, 1.0)]  # seconds per sample of rank 0 and rank 1, measurement after measurement


class Injected:
    """A speed source that reports this rank's next figure from SPEEDS, whatever the clock says."""

    def __init__(self, rank: int) -> None:
        self.rank, self.calls = rank, 0

    def __call__(self, samples: int, busy_s: float) -> float:
        value = SPEEDS[self.calls % len(SPEEDS)][self.rank]
        self.calls += 1
        return value


def dataset() -> torch.utils.data.TensorDataset:
    gen = torch.Generator().manual_seed(8)
    return torch.utils.data.TensorDataset(torch.randn(N, IN, generator=gen),
                                          torch.randint(0, CLASSES, (N,), generator=gen), torch.arange(N))


def net() -> nn.Module:
    torch.manual_seed(2)
    return nn.Sequential(nn.Linear(IN, 8), nn.Tanh(), nn.Linear(8, CLASSES))


def _steps(model: nn.Module, opt: torch.optim.Optimizer, loader: Any, epochs: range, seen: list,
           stop_after: int | None = None) -> bool:
    """Train; ``seen`` gets each step's sample indices. True when stopped after ``stop_after`` steps."""
    for epoch in epochs:
        loader.set_epoch(epoch)
        for x, y, idx in loader:
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
            seen.append((epoch, idx.tolist()))
            if stop_after is not None and len(seen) == stop_after:
                return True
    return False


def flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in px.unwrap(model).parameters()])


def balanced(epochs: int, stop_at: int) -> dict[str, Any]:
    px.init()
    out: dict[str, Any] = {}
    # -- 2 workers, the split measured every EVERY steps ---------------------------------------------------------
    model = net()
    model, opt = px.wrap(model, torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9))
    loader = px.shard(dataset(), batch_size=B, seed=1, balance="speed", rebalance_every=EVERY,
                      speed=Injected(px.rank()))
    seen: list = []
    _steps(model, opt, loader, range(epochs), seen)
    out["params"], out["seen"] = flat(model), seen
    # -- the same, stopped at step stop_at and resumed from the loader's state in a new loader ----------------
    model = net()
    model, opt = px.wrap(model, torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9))
    speed = Injected(px.rank())  # the measurement goes on where it was (a restarted job measures afresh)
    loader = px.shard(dataset(), batch_size=B, seed=1, balance="speed", rebalance_every=EVERY, speed=speed)
    resumed: list = []
    _steps(model, opt, loader, range(epochs), resumed, stop_after=stop_at)
    state = loader.state_dict()
    out["saved_shares"] = state["balance"]["shares"]
    loader = px.shard(dataset(), batch_size=B, seed=1, balance="speed", rebalance_every=EVERY, speed=speed)
    loader.load_state_dict(state)
    epoch = state["epoch"]
    _steps(model, opt, loader, range(epoch, epochs), resumed)
    out["resumed_params"], out["resumed_seen"] = flat(model), resumed
    # -- the oracle: one process, the global batch of 2B --------------------------------------------------------
    model = net()
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    oracle: list = []
    _steps(model, opt, px.shard(dataset(), batch_size=2 * B, seed=1, rank=0, world_size=1), range(epochs), oracle)
    out["oracle"], out["oracle_seen"] = flat(model), oracle
    px.shutdown()
    return out
