"""Worker functions for tests/test_ps_multiproc.py: real processes, real servers, digits data.

Servers come from ``PHALANX_PS_ADDRS`` when the test passes ``servers.env()``,
otherwise each worker hosts a colocated one.
"""
from __future__ import annotations

import itertools
import time
from typing import Any

import torch
import torch.nn.functional as F

import phalanx as px
from phalanx.models import digits_cnn, load_digits_split
from phalanx.ps.config import PSConfig
from phalanx.testing import kill_at

BATCH = 32  # per worker


def _strategy(name: str, opts: dict[str, Any]) -> px.Strategy:
    opts = dict(opts)
    if "adagrad_lr" in opts:
        opts["server_optimizer"] = px.ps.Adagrad(lr=opts.pop("adagrad_lr"))
    return {"downpour": px.Downpour, "easgd-async": px.AsyncEASGD, "ps-sync": px.ParameterServer}[name](**opts)


def accuracy(model: torch.nn.Module, data) -> float:
    x, y = data.tensors
    with torch.no_grad():
        return (model(x).argmax(1) == y).float().mean().item()


def train(strategy: str, opts: dict[str, Any], epochs: int, lr: float, momentum: float = 0.0,
          kill: dict[str, int] | None = None, seed: int = 0) -> dict[str, Any]:
    """Train the digits CNN under ``strategy``; optionally ``kill`` = {"rank": r, "step": s}."""
    px.init()
    torch.manual_seed(seed + px.rank())  # replicas need not start equal: the servers' first copy wins
    train_set, test_set = load_digits_split()
    net = digits_cnn()
    opt = torch.optim.SGD(net.parameters(), lr=lr, momentum=momentum)
    model, opt = px.wrap(net, opt, strategy=_strategy(strategy, opts))
    loader = px.shard(train_set, batch_size=BATCH, seed=seed)
    step = 0
    for epoch in range(epochs):
        loader.set_epoch(epoch)
        for x, y in loader:
            step += 1
            if kill:
                kill_at(kill["step"], rank=kill["rank"], now=step)
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
    strategy_obj = px.strategy_of(opt)
    load = px.ps.load_report(strategy_obj).as_dict()
    strategy_obj.finish()  # the servers' parameters (or the EASGD centre) into the model
    params = [p.detach().clone() for p in net.parameters()]
    return {"acc": accuracy(net, test_set), "finite": all(bool(torch.isfinite(p).all()) for p in params),
            "steps": step, "dropped": getattr(strategy_obj, "dropped", 0), "load": load, "params": params}


def sync_vs_allreduce(steps: int, lr: float, momentum: float) -> dict[str, list[torch.Tensor]]:
    """The same steps under AllReduce and under the synchronous PS (colocated servers)."""
    px.init()
    train_set, _ = load_digits_split()
    out = {}
    for name, strategy in (("allreduce", px.AllReduce()), ("ps-sync", px.ParameterServer(sync=True))):
        torch.manual_seed(100 + px.rank())  # different on purpose: both must start from rank 0's weights
        net = digits_cnn()
        model, opt = px.wrap(net, torch.optim.SGD(net.parameters(), lr=lr, momentum=momentum), strategy=strategy)
        loader = px.shard(train_set, batch_size=16, seed=0)
        loader.set_epoch(0)
        for x, y in itertools.islice(loader, steps):
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
        strategy.finish()
        out[name] = [p.detach().clone() for p in net.parameters()]
    return out


def late_join(after_versions: int, seed: int = 123) -> dict[str, Any]:
    """A brand-new process joins a running Downpour job once its servers are ``after_versions`` in."""
    px.init()
    while True:  # wait for the job to make progress; the test bounds how long with its timeout
        load = px.ps.load_report(PSConfig.from_environ().addrs)
        if min(load.shards) and min(a // s for a, s in zip(load.applied, load.shards, strict=True)) >= after_versions:
            break  # every push updates each of a server's shards once: applied / shards = pushes so far
        time.sleep(0.05)
    torch.manual_seed(seed)
    net = digits_cnn()
    own = [p.detach().clone() for p in net.parameters()]
    strategy = px.Downpour()
    model, opt = px.wrap(net, torch.optim.SGD(net.parameters(), lr=0.05), strategy=strategy)
    joined = [p.detach().clone() for p in net.parameters()]
    versions = dict(strategy.table.versions)
    train_set, test_set = load_digits_split()
    x, y = train_set.tensors
    opt.zero_grad()
    F.cross_entropy(model(x[:BATCH]), y[:BATCH]).backward()
    opt.step()  # it contributes: one push, answered with the newest parameters
    after = dict(strategy.table.versions)
    acc_joined = _accuracy_of(joined, test_set)
    strategy.finish()
    return {"own": own, "joined": joined, "versions": versions, "after": after, "acc_joined": acc_joined}


def _accuracy_of(params: list[torch.Tensor], test_set) -> float:
    net = digits_cnn()
    with torch.no_grad():
        for p, v in zip(net.parameters(), params, strict=True):
            p.copy_(v)
    return accuracy(net, test_set)
