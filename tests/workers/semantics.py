"""Worker functions for tests/test_semantics.py: what user code around the optimizer sees.

Each experiment computes its single-process oracle in the same worker (no collectives),
so one pair of processes checks clipping, AMP skips and uneven batch weights.
"""
from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn.functional as F

import phalanx as px
from phalanx.step.clock import set_batch_weight

from support.loop import strategies
from workers.core import IN, CLASSES, net

GLOBAL = 16      # global batch; each of the 2 workers holds half
MAX_NORM = 0.05  # small enough that every step clips
INF_LOSS = float("inf")


def data(steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(7)
    return [(torch.randn(GLOBAL, IN, generator=gen), torch.randint(0, CLASSES, (GLOBAL,), generator=gen))
            for _ in range(steps)]


def mine(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[0] // px.world_size()
    return x[px.rank() * half:(px.rank() + 1) * half]


def params(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in px.unwrap(model).parameters()]


def sgd(ps: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(ps, lr=0.5, momentum=0.9)


# -- clipping ---------------------------------------------------------------------------------------
def clipped(strategy: px.Strategy | None, steps: int) -> tuple[list[torch.Tensor], list[float]]:
    """Train with clip_grad_norm_ between backward and step; strategy None is ONE process on the global batch."""
    model = net(0)
    opt = sgd(model.parameters())
    if strategy is not None:
        model, opt = px.wrap(model, opt, strategy=strategy)
    norms = []
    for x, y in data(steps):
        if strategy is not None:
            x, y = mine(x), mine(y)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)))
        opt.step()
    return params(model), norms


def clipping(steps: int = 4) -> dict[str, Any]:
    oracle, oracle_norms = clipped(None, steps)
    out: dict[str, Any] = {"oracle": oracle, "oracle_norms": oracle_norms}
    for name, make in (("allreduce", px.AllReduce), ("local-warmup", lambda: px.LocalSGD(every=4, warmup_steps=steps)),
                       ("fp16", lambda: px.AllReduce(compression=px.FP16()))):
        out[name], out[name + "_norms"] = clipped(make(), steps)
    return out


# -- AMP: GradScaler finds inf on rank 1 only ---------------------------------------------------------
def amp_run(strategy: px.Strategy | None, steps: int, bad: set[int], replica: int | None = None) -> dict[str, Any]:
    """GradScaler loop; the loss is inf on rank 1 at the steps in ``bad``.

    strategy None: ONE process on the global batch (``replica`` None) or one replica's
    local loop on its half (``replica`` r), for the oracles.
    """
    model = net(0)
    opt = sgd(model.parameters())
    if strategy is not None:
        model, opt = px.wrap(model, opt, strategy=strategy)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8)
    rank = px.rank() if replica is None else replica
    for step, (x, y) in enumerate(data(steps), start=1):
        if strategy is not None or replica is not None:
            half = GLOBAL // 2
            x, y = x[rank * half:(rank + 1) * half], y[rank * half:(rank + 1) * half]
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        if step in bad and (rank == 1 or (strategy is None and replica is None)):
            loss = loss * INF_LOSS  # the overflow AMP guards against, on rank 1 only
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(opt)
        scaler.update()
    out = {"scale": scaler.get_scale()}
    if strategy is not None:
        out["steps_before_finish"] = strategy.steps
        strategy.finish()
        out["steps"] = strategy.steps
        out["state_step"] = strategy.state_with_step()["step"]
        if isinstance(strategy, px.EASGD):
            out["centre"] = [c.clone() for c in strategy.centre]
    out["params"] = params(model)
    return out


def local_sgd_oracle(steps: int, every: int, bad: set[int]) -> list[torch.Tensor]:
    """Two replicas in ONE process; replica 1 skips its step where it found inf; average every ``every`` steps."""
    replicas = [net(0), net(0)]
    opts = [sgd(m.parameters()) for m in replicas]
    for step, (x, y) in enumerate(data(steps), start=1):
        half = GLOBAL // 2
        for r, (model, opt) in enumerate(zip(replicas, opts, strict=True)):
            opt.zero_grad()
            F.cross_entropy(model(x[r * half:(r + 1) * half]), y[r * half:(r + 1) * half]).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            if not (r == 1 and step in bad):
                opt.step()
        if step % every == 0:
            with torch.no_grad():
                for a, b in zip(replicas[0].parameters(), replicas[1].parameters(), strict=True):
                    a.copy_((a + b) / 2)
                    b.copy_(a)
    return params(replicas[0])


AMP: dict[str, Callable[[], px.Strategy]] = strategies(every=2)


def amp(steps: int = 6) -> dict[str, Any]:
    bad = {2, steps}  # a sync step mid-run, and the last step (closed by finish())
    out: dict[str, Any] = {name: amp_run(make(), steps, bad) for name, make in AMP.items()}
    out["oracle_allreduce"] = amp_run(None, steps, bad)["params"]  # one process: the bad steps are skipped
    out["oracle_local_sgd"] = local_sgd_oracle(steps, 2, bad)
    return out


# -- uneven batch weights -------------------------------------------------------------------------------
def weighted_grads(strategy: px.Strategy | None, x: torch.Tensor, y: torch.Tensor, weight: float) -> list:
    model = net(0)
    opt = sgd(model.parameters())
    if strategy is not None:
        model, opt = px.wrap(model, opt, strategy=strategy)
    set_batch_weight(weight)
    try:
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
    finally:
        set_batch_weight(1.0)
    return [p.grad.detach().clone() for p in px.unwrap(model).parameters()]


def uneven() -> dict[str, Any]:
    x, y = data(1)[0]
    x, y = x[:4], y[:4]
    out: dict[str, Any] = {"oracle": weighted_grads(None, x, y, 1.0)}
    splits = {"3/1": (3, 1.5 if px.rank() == 0 else 0.5), "4/0": (4, 2.0 if px.rank() == 0 else 0.0)}
    for split, (cut, weight) in splits.items():
        xs, ys = (x[:cut], y[:cut]) if px.rank() == 0 else (x[cut:], y[cut:])
        for name, make in (("allreduce", px.AllReduce), ("topk1", lambda: px.AllReduce(compression=px.TopK(1.0))),
                           ("local-warmup", lambda: px.LocalSGD(every=4, warmup_steps=4))):
            out[f"{name} {split}"] = weighted_grads(make(), xs, ys, weight)
    return out


# -- wrap-time checks and point-to-point ------------------------------------------------------------
def wrapping() -> dict[str, Any]:
    """A model that differs on rank 1 is refused on both ranks; exchange_with swaps tensors, accounted."""
    hidden = 8 if px.rank() == 0 else 9
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(IN, hidden), torch.nn.Tanh(), torch.nn.Linear(hidden, CLASSES))
    try:
        px.wrap(model, sgd(model.parameters()))
        refused = None
    except px.ConfigError as err:
        refused = str(err)
    ddp, _ = px.wrap(net(0), sgd(net(0).parameters()))
    try:
        px.wrap(ddp, sgd(ddp.parameters()))
        rewrapped = None
    except px.ConfigError as err:
        rewrapped = str(err)
    comm = px.Comm()
    mine = [torch.full((3,), float(px.rank())), torch.arange(2, dtype=torch.int64) + 10 * px.rank()]
    theirs = comm.exchange_with(1 - px.rank(), mine)
    return {"refused": refused, "rewrapped": rewrapped, "theirs": theirs, "bytes": comm.stats.bytes_sent}


def semantics(parts: tuple[str, ...] = ("clipping", "amp", "uneven", "wrapping")) -> dict[str, Any]:
    import warnings
    px.init()
    torch.set_num_threads(1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # TopK(1.0) warns that it sends more than dense; here it is exact
        return {part: globals()[part]() for part in parts}
