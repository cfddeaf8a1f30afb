"""Worker functions for tests/step/test_compile.py: a compiled tiny MLP under each strategy, 2 real workers.

Every case trains the same model from the same data three ways on the same two
processes: eager, ``px.wrap(torch.compile(model))`` and ``torch.compile`` of the module
``px.wrap`` returned; the oracle (one process, batch 2b, compiled) runs on each rank
from the same global batches. The last batch is uneven, so the batch-weight hooks act.
"""
from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

import phalanx as px
from phalanx.step.compiled import compilations, graph_breaks
from support.loop import train
from phalanx.strategies.allreduce import REBUILT

IN, CLASSES, B = 8, 3, 4
N = 2 * B * 3 + 3  # three even steps of 2 x 4 samples, then 2 + 1: uneven, and second input shapes


def dataset() -> torch.utils.data.TensorDataset:
    gen = torch.Generator().manual_seed(7)
    return torch.utils.data.TensorDataset(torch.randn(N, IN, generator=gen), torch.randint(0, CLASSES, (N,),
                                                                                           generator=gen))


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(IN, 16), nn.Tanh(), nn.Linear(16, CLASSES))


def _overlapped() -> px.Strategy:
    return px.AllReduce(bucket_mb=0.0003)  # a few buckets; the group's elastic flag selects the hooks path


CASES: dict[str, Callable[[], px.Strategy]] = {
    "allreduce": px.AllReduce,
    "overlap": _overlapped,
    "powersgd": lambda: px.AllReduce(px.PowerSGD(rank=2)),
    "localsgd": lambda: px.LocalSGD(every=2),
    "diloco": lambda: px.DiLoCo(every=2),
    "ps": lambda: px.ParameterServer(sync=True, servers="colocated"),
}
EXACT = ("allreduce", "overlap", "ps")  # equal one process on the global batch (the others are their own rule)


def _flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in px.unwrap(model).parameters()])


def _run(case: str, order: str, backend: str, epochs: int) -> dict[str, Any]:
    torch.compiler.reset()
    net = mlp()
    opt = torch.optim.SGD(net.parameters(), lr=0.2, momentum=0.9)
    strategy = CASES[case]()
    rebuilt = REBUILT.of(px.current_group())
    # what `phalanx run --elastic` records for the group (it may be rebuilt with joiners): the overlapped hooks
    rebuilt.value = "tests" if case == "overlap" else None
    try:
        if order == "before":
            model, opt = px.wrap(torch.compile(net, backend=backend), opt, strategy=strategy)
        else:
            model, opt = px.wrap(net, opt, strategy=strategy)
            if order == "after":
                model = torch.compile(model, backend=backend)
    finally:
        rebuilt.value = None
    graphs0, breaks0 = compilations(), graph_breaks()
    train(model, opt, px.shard(dataset(), batch_size=B, shuffle=True, seed=3), epochs)
    strategy.finish()
    return {"params": _flat(model), "graphs": compilations() - graphs0, "breaks": graph_breaks() - breaks0,
            "steps": strategy.steps}


def oracle(backend: str, epochs: int) -> torch.Tensor:
    """One process, batch 2b, compiled: what the exact strategies must equal."""
    torch.compiler.reset()
    net = mlp()
    opt = torch.optim.SGD(net.parameters(), lr=0.2, momentum=0.9)
    model = torch.compile(net, backend=backend)
    train(model, opt, px.shard(dataset(), batch_size=2 * B, shuffle=True, seed=3, rank=0, world_size=1), epochs)
    return _flat(net)


def bypassed(backend: str) -> str:
    """``torch.compile(net)`` trained after ``px.wrap(net)``: DDP's forward never runs, so nothing is averaged."""
    torch.compiler.reset()
    net = mlp()
    handle = torch.compile(net, backend=backend)  # the compiled module px.wrap never saw
    _, opt = px.wrap(net, torch.optim.SGD(net.parameters(), lr=0.1))
    x, y = dataset().tensors
    try:
        F.cross_entropy(handle(x[:B]), y[:B]).backward()
    except px.ConfigError as err:
        return str(err)
    return "trained without an error"


def equivalence(cases: list[str], orders: list[str], backend: str, epochs: int) -> dict[str, Any]:
    """Each case under each order (``eager`` is the uncompiled reference), then the refused bypass."""
    px.init()
    out: dict[str, Any] = {"oracle": oracle(backend, epochs)}
    for case in cases:
        for order in ["eager", *orders]:
            out[f"{case}/{order}"] = _run(case, order, backend, epochs)
    out["bypassed"] = bypassed(backend)
    return out

