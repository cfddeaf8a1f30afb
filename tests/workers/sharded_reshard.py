"""Worker for tests/elastic/test_elastic_sharded.py: ``reshard`` on 2 live processes, no launcher.

A model with tied weights, a buffer and uneven first dimensions (7 rows: shards of 4 and 3;
1 row: shards of 1 and 0) trains 2 AdamW steps on FSDP over both ranks (1 x 2). Its commit
(:func:`phalanx.sharding.reshard.local_parts`) is re-laid out as 2 x 1 (each rank then holds every row:
it receives the rows of the other shard) and back as 1 x 2 (every row is held already: nothing
is sent); after one more step the model equals one process that trained 3 steps on the same batch.
"""
from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch
from torch import nn

import phalanx as px
from phalanx.sharding.reshard import let_go, local_parts, reshard
from phalanx.sharding.layout import sharded_by


class Odd(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.a, self.b, self.c = nn.Linear(5, 7), nn.Linear(7, 7), nn.Linear(7, 7)
        self.c.weight = self.b.weight  # tied
        self.head = nn.Linear(7, 1)
        self.register_buffer("scale", torch.tensor([1.5]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.c(torch.tanh(self.b(torch.tanh(self.a(x))))))) * self.scale


def _step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor) -> None:
    opt.zero_grad()
    model(x).square().mean().backward()
    opt.step()


def _whole(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().reshape(-1)


def _state(model: nn.Module, opt: torch.optim.Optimizer) -> torch.Tensor:
    """Every parameter and Adam moment, whole (a collective for DTensors), flattened in order."""
    moments = [s[k] for s in opt.state.values() for k in ("exp_avg", "exp_avg_sq")]
    return torch.cat([_whole(t) for t in [*model.parameters(), *moments]])


def relayout() -> dict[str, Any]:
    px.init()
    torch.set_num_threads(1)
    x = torch.randn(6, 5, generator=torch.Generator().manual_seed(4))  # the same batch on both ranks
    oracle = Odd()
    oracle_opt = torch.optim.AdamW(oracle.parameters(), lr=0.05)
    for _ in range(3):
        _step(oracle, oracle_opt, x)
    net = Odd()
    model, opt = px.wrap(net, torch.optim.AdamW(net.parameters(), lr=0.05), strategy=px.AllReduce(),
                         shard=px.FullyShard(group_size=2, min_params=1))
    for _ in range(2):
        _step(model, opt, x)
    shard = sharded_by(opt)
    out: dict[str, Any] = {}
    for size in (1, 2):  # 1 x 2 -> 2 x 1 -> 1 x 2
        before = _state(model, opt)
        commit = {"model": local_parts(model.state_dict()), "optimizer": local_parts(opt.state_dict())}
        shard.group_size = size
        moved = reshard(shard, model, opt, px.strategy_of(opt), px.current_group(), commit)
        out[f"to{size}"] = {**moved, "diff": (_state(model, opt) - before).abs().max().item(),
                            "shard_size": shard.shard_size, "tied": model.c.weight is model.b.weight}
    _step(model, opt, x)
    out["diff"] = max((_whole(p) - q.detach().reshape(-1)).abs().max().item()
                      for p, q in zip(model.parameters(), oracle.parameters(), strict=True))
    return out


def let_go_closes_the_sockets() -> dict[str, Any]:
    """Rank 1 waits in an all-reduce with rank 0 on the mesh's "replicate" group (HSDP 2 x 1, as FSDP's gradient
    all-reduce waits on the other replica group); rank 0, which will never join it, lets go of its layout
    (:func:`phalanx.sharding.reshard.let_go`) and drops the generation's groups, as a survivor does before a
    regroup. Rank 1's collective must then fail at once ("Connection closed by peer"), while rank 0 still runs:
    rank 0 waits, bounded, for rank 1's word that it failed. A reference left anywhere (FSDP's state, a DTensor's
    mesh, DTensor's mesh-keyed caches) keeps the sockets open, and rank 1 waits for its collective timeout."""
    g = px.init()
    torch.set_num_threads(1)
    x = torch.randn(6, 5, generator=torch.Generator().manual_seed(4))
    net = Odd()
    model, opt = px.wrap(net, torch.optim.AdamW(net.parameters(), lr=0.05), strategy=px.AllReduce(),
                         shard=px.FullyShard(group_size=1, min_params=1))
    for _ in range(2):
        _step(model, opt, x)
    whole = _state(model, opt)  # full_tensor(): DTensor's redistribution caches now hold the mesh, as in a job
    replicate = g.mesh(1)["replicate"].get_group()
    store = g.store
    if g.rank == 1:
        store.set("in_all_reduce", "1")
        try:
            torch.distributed.all_reduce(torch.ones(1), group=replicate)
            return {"failed": False}
        except Exception as err:  # noqa: BLE001 - the peer's closed connection, whatever torch calls it
            store.set("failed", "1")
            return {"failed": True, "error": type(err).__name__, "whole": whole.numel()}
    store.wait(["in_all_reduce"])
    del replicate  # this function's own reference: the test is about the layout's
    let_go(model, opt, px.strategy_of(opt))
    g.drop_process_groups()
    try:  # half rank 1's collective timeout: its failure seen here came from our sockets closing, not its timeout
        store.wait(["failed"], timedelta(seconds=g.timeout_s / 2))
        seen = True
    except Exception:  # noqa: BLE001 - not within the bound: our sockets stayed open
        seen = False
    return {"peer_failed_while_we_ran": seen, "meta": all(p.is_meta for p in model.parameters()),
            "whole": whole.numel()}


def relayout_then_let_go() -> dict[str, Any]:
    """:func:`relayout`, then :func:`let_go_closes_the_sockets` on the same two processes (one start-up for both
    tests/elastic/test_elastic_sharded.py scenarios): the second runs on the group the first left behind, so it
    also proves that a layout already resharded twice and dropped leaves no socket open either."""
    out = {"relayout": relayout()}
    out["let_go"] = let_go_closes_the_sockets()
    return out
