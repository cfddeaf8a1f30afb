"""Worker functions for tests/sharding/test_sharding.py: sharded training against its oracles (issue 21, item 1).

``gradient_oracle``: px.AllReduce on a sharded model (FSDP with S = world size, HSDP with
2 x 2) equals one process on the global batch, with AdamW, clipping, a scheduler and a short
last global batch (the batch weight). The oracle runs in the same worker.

``across_groups``: LocalSGD and DiLoCo on 2 replica groups of 2 shards equal the same rule on 2
unsharded replicas (ranks of the same shard index run them over the mesh's "replicate" group,
each on its group's samples), and send half the bytes per rank.
"""
from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

import phalanx as px
from support.loop import classification, mlp

IN, HIDDEN, CLASSES = 6, 8, 4  # every tensor's first dimension is even: 2 shards split it exactly


def dataset(n: int) -> torch.utils.data.TensorDataset:
    return classification(n, IN, CLASSES, seed=8)


def net() -> nn.Module:
    return mlp(IN, HIDDEN, CLASSES, seed=2)


class Tied(nn.Module):
    """Two hidden layers sharing one weight (as a GPT's embedding and output layer do)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(2)
        self.a, self.b, self.c = nn.Linear(IN, HIDDEN), nn.Linear(HIDDEN, HIDDEN), nn.Linear(HIDDEN, HIDDEN)
        self.c.weight = self.b.weight
        self.head = nn.Linear(HIDDEN, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.c(torch.tanh(self.b(torch.tanh(self.a(x)))))))


def full(model: nn.Module) -> torch.Tensor:
    """Every parameter, whole (a sharded model's DTensors gathered), flattened in order."""
    parts = [p.full_tensor() if hasattr(p, "full_tensor") else p for p in model.parameters()]
    return torch.cat([p.detach().reshape(-1) for p in parts])


def _train_global(shard: px.FullyShard | None, n: int, batch: int, *, unweighted: bool = False,
                  accumulate: bool = False, make: Callable[[], nn.Module] = net) -> nn.Module:
    model = make()
    opt = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1)
    if shard is None:  # the oracle: one process, the whole global batch
        loader = px.shard(dataset(n), batch_size=batch * px.world_size(), seed=1, rank=0, world_size=1)
    else:
        model, opt = px.wrap(model, opt, strategy=px.AllReduce(), shard=shard)
        loader = px.shard(dataset(n), batch_size=batch, seed=1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    for epoch in range(2):
        loader.set_epoch(epoch)
        for x, y in loader:
            if unweighted:  # the break: every part counts the same, whatever its size
                px.step.clock.set_batch_weight(1.0)
            opt.zero_grad()
            if accumulate:  # two micro-batches, the first under px.no_sync; each loss a sum over the part's size
                half = len(x) // 2
                with px.no_sync(model):
                    (F.cross_entropy(model(x[:half]), y[:half], reduction="sum") / max(1, len(x))).backward()
                (F.cross_entropy(model(x[half:]), y[half:], reduction="sum") / max(1, len(x))).backward()
            else:
                F.cross_entropy(model(x), y).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.3)
            opt.step()
            sched.step()
    return model


def gradient_oracle(n: int, batch: int, group_size: int, path: str, unweighted: bool = False,
                    accumulate: bool = False, tied: bool = False) -> dict[str, Any]:
    px.init()
    torch.set_num_threads(1)
    oracle = full(_train_global(None, n, batch))
    model = _train_global(px.FullyShard(group_size=group_size), n, batch, unweighted=unweighted)
    px.save(model, path)  # collective for a sharded model; rank 0 writes a plain state_dict
    out = {"diff": (full(model) - oracle).abs().max().item(),
           "sharded": all(type(p).__name__ == "DTensor" for p in model.parameters())}
    if accumulate:
        out["accumulated_diff"] = (full(_train_global(px.FullyShard(group_size=group_size), n, batch,
                                                      accumulate=True)) - oracle).abs().max().item()
    if tied:  # every submodule its own FSDP unit (min_params=1), but the tied pair must stay in one
        model = _train_global(px.FullyShard(group_size=group_size, min_params=1), n, batch, make=Tied)
        out["tied_diff"] = (full(model) - full(_train_global(None, n, batch, make=Tied))).abs().max().item()
    if px.rank() == 0:
        plain = net()
        plain.load_state_dict(torch.load(path, weights_only=True))
        out["saved_diff"] = (full(plain) - oracle).abs().max().item()
    return out


RULES: dict[str, Callable[[], px.Strategy]] = {
    "local-sgd": lambda: px.LocalSGD(every=2),
    "diloco": lambda: px.DiLoCo(every=2),
    "diloco-fp16": lambda: px.DiLoCo(every=2, compression=px.FP16()),
    # all-gathered messages (issue 39 item 4): over the replicate group, not the whole world
    "diloco-sparseloco": lambda: px.DiLoCo(every=2, compression=px.SparseLoCo(topk=4, chunk=16)),
    "easgd": lambda: px.EASGD(every=2),
    # two fragments on staggered schedules, each exchange overlapped by one step and mixed in (issue 39 item 4)
    "streaming": lambda: px.StreamingDiLoCo(every=2, fragments=2, overlap=1),
}


def _train_local(rule: str, shard: px.FullyShard | None, batch: int, steps: int) -> tuple[torch.Tensor, float]:
    """Each replica group r trains on samples [r*2b, (r+1)*2b) of each global batch of 4b; shard s on its half."""
    g = px.current_group()
    mesh = g.mesh(2)
    replica, s = divmod(px.rank(), 2)
    model = net()
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    strategy = RULES[rule]()
    if shard is None:  # an unsharded replica per group, over the replicate group of this rank's shard index
        strategy.comm = px.Comm(process_group=mesh["replicate"].get_group())
        model, opt = px.wrap(model, opt, strategy=strategy)
        lo, hi = replica * 2 * batch, (replica + 1) * 2 * batch
    else:
        model, opt = px.wrap(model, opt, strategy=strategy, shard=shard)
        lo, hi = (2 * replica + s) * batch, (2 * replica + s + 1) * batch
    x, y = dataset(4 * batch * steps).tensors
    for step in range(steps):
        at = 4 * batch * step
        opt.zero_grad()
        F.cross_entropy(model(x[at + lo:at + hi]), y[at + lo:at + hi]).backward()
        opt.step()
    strategy.finish()
    return full(model), strategy.bytes_per_step


def across_groups(rules: list[str], batch: int, steps: int) -> dict[str, Any]:
    px.init()
    torch.set_num_threads(1)
    out: dict[str, Any] = {}
    for rule in rules:
        ref, ref_bytes = _train_local(rule, None, batch, steps)
        mine, my_bytes = _train_local(rule, px.FullyShard(group_size=2), batch, steps)
        out[rule] = {"diff": (mine - ref).abs().max().item(), "bytes": my_bytes, "ref_bytes": ref_bytes}
    return out




def hsdp_and_groups(n: int, batch: int, path: str, rules: list[str], steps: int) -> dict[str, Any]:
    """Both 2 x 2 checks in one start of 4 processes."""
    return {**gradient_oracle(n, batch, 2, path), **across_groups(rules, batch, steps)}
