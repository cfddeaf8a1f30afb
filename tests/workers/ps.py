"""Worker functions for tests/ps/test_ps_multiproc.py: real processes, real servers, digits data.

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
from phalanx.bench.models import digits_cnn, load_digits_split
from phalanx.ps.config import PSConfig
from support.procs import kill_at
from support.wait import until

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
    def progressed() -> bool:  # every push updates each of a server's shards once: applied / shards = pushes so far
        load = px.ps.load_report(PSConfig.from_environ().addrs)
        return bool(min(load.shards)) and min(a // s for a, s in zip(load.applied, load.shards, strict=True)) \
            >= after_versions

    until(progressed, timeout=600, what=f"{after_versions} pushes on the servers")
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
    loss = {"own": _loss_of(own, test_set), "joined": _loss_of(joined, test_set)}
    strategy.finish()
    final = [p.detach().clone() for p in net.parameters()]  # the servers' model when this worker left
    return {"own": own, "joined": joined, "versions": versions, "after": after, "loss": loss, "final": final}


def _loss_of(params: list[torch.Tensor], test_set) -> float:
    net = digits_cnn()
    x, y = test_set.tensors
    with torch.no_grad():
        for p, v in zip(net.parameters(), params, strict=True):
            p.copy_(v)
        return F.cross_entropy(net(x), y).item()


# -- resume, non-contiguous parameters, finish() ---------------------------------------------------
def _tiny(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(10, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))


def _batch(step: int, rank: int, n: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """The same data in every run: a function of (step, rank) only."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(n, 10, generator=g), torch.randint(0, 3, (n,), generator=g)


RESUMABLE = {
    "downpour": lambda servers: px.Downpour(push_every=2, pull_every=2, server_optimizer=px.ps.Adagrad(lr=0.05),
                                            servers=servers),
    "easgd-async": lambda servers: px.AsyncEASGD(every=2, alpha=0.4, servers=servers),
    "ps-sync": lambda servers: px.ParameterServer(sync=True, servers=servers),
}


def _run(model, opt, start: int, stop: int, *, lockstep: bool, save_at: int | None = None,
         path: str | None = None) -> None:
    """Steps ``start..stop``. ``lockstep``: ranks take turns (a barrier after each), so that an asynchronous
    strategy's server updates arrive in the same order in every run, and the oracle can be exact."""
    for step in range(start, stop):
        for turn in (range(px.world_size()) if lockstep else [px.rank()]):
            if turn == px.rank():
                x, y = _batch(step, px.rank())
                opt.zero_grad()
                F.cross_entropy(model(x), y).backward()
                opt.step()
            if lockstep:
                px.barrier()
        if step + 1 == save_at:
            px.save_checkpoint(path, model, opt)


def _params(net: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in net.parameters()]


def _maxdiff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max((x - y).abs().max().item() for x, y in zip(a, b, strict=True))


def resume_equals_uninterrupted(servers: dict[str, list[list[str]]], steps: int, save_at: int,
                                path: str) -> dict[str, dict[str, float]]:
    """Each PS strategy, colocated and on separate servers: train ``steps``; then resume from the checkpoint
    written at ``save_at`` into a new model (other init) on new, empty servers, and train to ``steps`` again."""
    px.init()
    out = {}
    for name, make in RESUMABLE.items():
        lockstep = name != "ps-sync"  # the synchronous PS is deterministic as it is (and would deadlock in turns)
        for mode in ("colocated", "separate"):
            where = ["colocated", "colocated"] if mode == "colocated" else servers[name]
            ckpt = f"{path}/{name}-{mode}.pt"
            net = _tiny(px.rank())
            model, opt = px.wrap(net, torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9),
                                 strategy=make(where[0]))
            _run(model, opt, 0, steps, lockstep=lockstep, save_at=save_at, path=ckpt)
            px.strategy_of(opt).finish()
            full = _params(net)
            net = _tiny(100 + px.rank())
            model, opt = px.wrap(net, torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9),
                                 strategy=make(where[1]))
            fresh = _params(net)  # what the new servers were registered with
            px.load_checkpoint(ckpt, model, opt)
            _run(model, opt, save_at, steps, lockstep=lockstep)
            px.strategy_of(opt).finish()
            resumed = _params(net)
            out[f"{name}/{mode}"] = {"diff": _maxdiff(full, resumed), "from_fresh": _maxdiff(full, fresh)}
    return out


def _conv_net(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    net = torch.nn.Sequential(torch.nn.Conv2d(3, 32, 3, padding=1), torch.nn.ReLU(),
                              torch.nn.Conv2d(32, 64, 3), torch.nn.ReLU(),  # 73 KB: split over both servers
                              torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(64, 10))
    return net.to(memory_format=torch.channels_last)


def channels_last(steps: int) -> dict[str, Any]:
    """A channels_last conv net on 2 colocated servers: sync PS vs AllReduce, and what Downpour receives."""
    px.init()
    out: dict[str, Any] = {}
    for name, strategy in (("allreduce", px.AllReduce()), ("ps-sync", px.ParameterServer(sync=True)),
                           ("downpour", px.Downpour())):
        net = _conv_net(7 + px.rank())  # ranks differ: each strategy must make them agree
        model, opt = px.wrap(net, torch.optim.SGD(net.parameters(), lr=0.05), strategy=strategy)
        for step in range(steps):
            g = torch.Generator().manual_seed(100 * step + px.rank())
            x = torch.randn(4, 3, 8, 8, generator=g).to(memory_format=torch.channels_last)
            y = torch.randint(0, 10, (4,), generator=g)
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
        if name == "downpour":
            table = strategy.table
            out["split"] = sorted({p.var for p in table.pieces if not p.whole})
            out["non_contiguous"] = [n for n, p in net.named_parameters() if not p.is_contiguous()]
            px.barrier()  # both workers' pushes are in: nothing moves between the pull and the snapshot
            table.pull()  # every piece of every parameter, written into the parameter itself
            held = table.snapshot()
            flat = {n: p.detach().reshape(-1) for n, p in net.named_parameters()}
            out["pull_vs_servers"] = max((flat[p.var][p.start:p.stop] - held[p.name]["value"].reshape(-1))
                                         .abs().max().item() for p in table.pieces)
        strategy.finish()
        out[name] = _params(net)
    return out


def finish_holds_everyones_pushes(steps: int, push_every: int, slow_rank: int) -> dict[str, Any]:
    """Downpour: ``slow_rank`` sleeps before its last step, so the other worker reaches finish() first."""
    px.init()
    net = _tiny(px.rank())
    strategy = px.Downpour(push_every=push_every, pull_every=1)
    model, opt = px.wrap(net, torch.optim.SGD(net.parameters(), lr=0.1), strategy=strategy)
    for step in range(steps):
        if px.rank() == slow_rank and step == steps - 1:
            time.sleep(1.0)  # sleep: the slow rank whose late push is under test
        x, y = _batch(step, px.rank())
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    strategy.finish()
    return {"params": _params(net), "versions": dict(strategy.table.versions)}


def semantics_under_ps(steps: int = 4, amp_steps: int = 6) -> dict[str, Any]:
    """Clipping and a GradScaler skip on rank 1 only, under the PS strategies (colocated servers)."""
    from workers.semantics import amp_run, clipped
    px.init()
    torch.set_num_threads(1)
    oracle, oracle_norms = clipped(None, steps)  # ONE process on the global batch
    ps, ps_norms = clipped(px.ParameterServer(sync=True, servers="colocated"), steps)
    bad = {2, amp_steps}  # rank 1 finds inf at a mid-run step and at the last one (closed by finish())
    amp = {name: amp_run(make(), amp_steps, bad) for name, make in (
        ("ps-sync", lambda: px.ParameterServer(sync=True, servers="colocated")),
        ("downpour", lambda: px.Downpour(servers="colocated")),
        ("easgd-async", lambda: px.AsyncEASGD(every=2, servers="colocated")))}
    amp["oracle_allreduce"] = amp_run(None, amp_steps, bad)["params"]
    return {"oracle": oracle, "oracle_norms": oracle_norms, "ps": ps, "ps_norms": ps_norms, "amp": amp}


def in_turn(calls: list[tuple[str, str, dict[str, Any]]]) -> dict[str, Any]:
    """Several of this module's jobs one after the other in the same processes (one fork per rank, not one per job):
    ``calls`` is ``[(name, function, kwargs)]``; returns each one's result by name. Each function calls
    ``px.init()`` (idempotent) and builds its own strategies, as it does alone.

    Example:
        >>> # run_workers("workers.ps:in_turn", calls=[("sync", "sync_vs_allreduce", {"steps": 6, ...})])
    """
    return {name: globals()[function](**kwargs) for name, function, kwargs in calls}
