"""Worker functions for tests/strategies/test_strategies.py: real processes, gloo, digits data.

Each function runs on every rank (``run_workers``) and returns plain values and
tensors. Several experiments share one pair of processes to save start-up time.
"""
from __future__ import annotations

import os
import warnings
from typing import Any, Callable

import torch
import torch.nn.functional as F

import phalanx as px

from support.loop import lockstep, train_steps as train, train as train_epochs
from phalanx.bench.models import digits_cnn, load_digits_split

BATCH = 32  # per worker


def params_of(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in px.unwrap(model).parameters()]


def build(strategy: px.Strategy, opt: Callable[[Any], torch.optim.Optimizer], seed: int = 0):
    torch.manual_seed(seed + px.rank())  # different on purpose: px.wrap must broadcast rank 0's weights
    net = digits_cnn()
    return (*px.wrap(net, opt(net.parameters()), strategy=strategy), strategy)


def sgd(lr: float = 0.1, momentum: float = 0.0):
    return lambda ps: torch.optim.SGD(ps, lr=lr, momentum=momentum)


def adam(lr: float = 1e-3):
    return lambda ps: torch.optim.Adam(ps, lr=lr)


def run(strategy: px.Strategy, opt, steps: int, train_set) -> list[torch.Tensor]:
    model, optimizer, _ = build(strategy, opt)
    train(model, optimizer, px.shard(train_set, batch_size=BATCH, seed=0), steps)
    return params_of(model)


def easgd_oracle(steps: int, every: int, alpha: float, lr: float) -> dict[str, Any]:
    """The paper's synchronous EASGD for two workers, computed in ONE process (no collectives)."""
    train_set, _ = load_digits_split()
    torch.manual_seed(0)
    first = digits_cnn()
    replicas = [first, digits_cnn()]
    replicas[1].load_state_dict(first.state_dict())
    opts = [torch.optim.SGD(m.parameters(), lr=lr) for m in replicas]
    loaders = [px.shard(train_set, batch_size=BATCH, seed=0, rank=r, world_size=2) for r in range(2)]
    centre = [p.detach().clone() for p in first.parameters()]
    for step in lockstep(replicas, opts, loaders):
        if step % every == 0:  # eqs. 5-6 of Zhang et al. 2015, with the x_i of before the pull
            with torch.no_grad():
                xs = [[p.detach().clone() for p in m.parameters()] for m in replicas]
                for model, x in zip(replicas, xs, strict=True):
                    for p, xi, c in zip(model.parameters(), x, centre, strict=True):
                        p.sub_(alpha * (xi - c))
                for j, c in enumerate(centre):
                    c.add_(alpha * sum(x[j] - c for x in xs))
        if step == steps:
            break
    return {"centre": centre, "replicas": [params_of(m) for m in replicas]}


def doc_example() -> dict[str, Any]:
    """Run the custom exchange rule from docs/strategies.md, extracted verbatim."""
    here = os.path.dirname(os.path.abspath(__file__))
    text = open(os.path.join(here, "..", "..", "docs", "strategies.md")).read()
    code = text.split("<!-- custom-rule -->")[1].split("```python")[1].split("```")[0]
    scope: dict[str, Any] = {}
    exec(compile(code, "docs/strategies.md", "exec"), scope)
    return scope


def exactness(ckpt_dir: str, steps: int = 6) -> dict[str, Any]:
    """Equivalences, the EASGD run, exact resume, bytes per step, the docs' custom rule."""
    px.init()
    train_set, _ = load_digits_split()
    out: dict[str, Any] = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        local1 = px.LocalSGD(every=1)
    out["warned"] = [str(w.message) for w in caught]
    out["allreduce"] = run(px.AllReduce(), sgd(), steps, train_set)
    out["local1"] = run(local1, sgd(), steps, train_set)
    out["diloco1"] = run(px.DiLoCo(every=1, outer_lr=1.0, outer_momentum=0.0), sgd(), steps, train_set)
    # post-local SGD's warm-up is true gradient averaging: equal to AllReduce even under Adam
    out["allreduce_adam"] = run(px.AllReduce(), adam(), steps, train_set)
    out["warmup_adam"] = run(px.LocalSGD(every=4, warmup_steps=steps), adam(), steps, train_set)

    easgd = px.EASGD(every=2, alpha=0.3)
    out["easgd_params"] = run(easgd, sgd(0.1), 8, train_set)
    out["easgd_centre"] = [c.clone() for c in easgd.centre]

    out["resume"] = {name: resume_pair(factory, ckpt_dir, name, train_set) for name, factory in RESUMABLE.items()}

    out["bytes"] = {}
    for name, strategy in (("allreduce", px.AllReduce()), ("fp16", px.AllReduce(compression=px.FP16())),
                           ("topk", px.AllReduce(compression=px.TopK(0.01))),
                           ("powersgd", px.AllReduce(compression=px.PowerSGD(rank=2))),
                           ("local8", px.LocalSGD(every=8)), ("diloco8", px.DiLoCo(every=8))):
        run(strategy, sgd(), 8, train_set)  # 8: one whole period of the every=8 strategies (a sync at step 8)
        out["bytes"][name] = strategy.bytes_per_step

    scope = doc_example()
    model, opt, strategy = build(scope["MajorityVote"](), sgd(0.01), seed=1)
    loader = px.shard(train_set, batch_size=BATCH, seed=0)
    loader.set_epoch(0)
    losses = []
    for x, y in loader:
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    out["doc"] = {"losses": losses, "params": params_of(model), "bytes_per_step": strategy.bytes_per_step,
                  "state": strategy.state_dict()}
    return out


# Strategies whose state must survive a checkpoint: anchor, outer momentum, residuals, Q matrices.
RESUMABLE: dict[str, Callable[[], px.Strategy]] = {
    "diloco": lambda: px.DiLoCo(every=3, compression=px.TopK(0.1)),
    "powersgd": lambda: px.AllReduce(compression=px.PowerSGD(rank=2)),
    "local-sgd": lambda: px.LocalSGD(every=4),
}


def resume_pair(factory, ckpt_dir: str, name: str, train_set, total: int = 10, cut: int = 5) -> dict[str, Any]:
    """The uninterrupted run vs. a run checkpointed at ``cut`` (not a sync point) and resumed in new objects."""
    model, opt, _ = build(factory(), sgd(0.05, momentum=0.9))
    train(model, opt, px.shard(train_set, batch_size=BATCH, seed=0), total)
    straight = params_of(model)

    model, opt, strategy = build(factory(), sgd(0.05, momentum=0.9))
    loader = px.shard(train_set, batch_size=BATCH, seed=0)
    train(model, opt, loader, cut)
    path = os.path.join(ckpt_dir, f"{name}.ckpt")
    # save_checkpoint is collective: rank 0's shared state, every rank's residuals, parameters and optimizer state.
    px.save_checkpoint(path, model, opt, loader=loader, step=cut)
    px.barrier()

    model, opt, strategy = build(factory(), sgd(0.05, momentum=0.9), seed=7)  # fresh objects, other weights
    loader = px.shard(train_set, batch_size=BATCH, seed=0)
    px.load_checkpoint(path, model, opt, loader=loader)
    train(model, opt, loader, total - cut, start_epoch=loader.sampler.epoch)
    return {"straight": straight, "resumed": params_of(model)}


# -- convergence ------------------------------------------------------------------------------------
def candidates(lr: float) -> dict[str, tuple[Callable[[], px.Strategy], Callable[[Any], torch.optim.Optimizer]]]:
    """Each strategy with the inner optimizer its paper uses: SGD with momentum, AdamW for DiLoCo."""
    momentum, adamw = sgd(lr, momentum=0.9), (lambda ps: torch.optim.AdamW(ps, lr=1e-3))
    return {
        "allreduce": (px.AllReduce, momentum),
        "local-sgd(8)": (lambda: px.LocalSGD(every=8), momentum),
        "post-local-sgd(40, 8)": (lambda: px.LocalSGD(every=8, warmup_steps=40), momentum),
        "diloco(8)": (lambda: px.DiLoCo(every=8), adamw),
        "diloco(8)+fp16": (lambda: px.DiLoCo(every=8, compression=px.FP16()), adamw),
        "easgd(4)": (lambda: px.EASGD(every=4), momentum),
        "fp16": (lambda: px.AllReduce(compression=px.FP16()), momentum),
        "topk(0.01)": (lambda: px.AllReduce(compression=px.TopK(0.01)), momentum),
        "threshold(1e-3)": (lambda: px.AllReduce(compression=px.Threshold(1e-3)), momentum),
        "powersgd(4)": (lambda: px.AllReduce(compression=px.PowerSGD(rank=4)), momentum),
    }


def exactness_then_convergence(ckpt_dir: str, epochs: int) -> dict[str, Any]:
    """:func:`exactness`, then :func:`convergence`, in one pair of processes (one start and one group for both)."""
    return {"exact": exactness(ckpt_dir), "trained": convergence(epochs)}


def convergence(epochs: int, batch: int = BATCH, lr: float = 0.05) -> dict[str, Any]:
    """Every strategy and compressor, one after another in this one pair of processes."""
    px.init()
    train_set, test_set = load_digits_split()
    x_test, y_test = test_set.tensors
    results = {}
    for name, (factory, opt) in candidates(lr).items():
        model, optimizer, strategy = build(factory(), opt)
        loader = px.shard(train_set, batch_size=batch, seed=0)
        train_epochs(model, optimizer, loader, epochs)
        strategy.finish()  # the template's finish: replicas agree on the model to keep
        with torch.no_grad():
            accuracy = (model(x_test).argmax(1) == y_test).float().mean().item()
        results[name] = {"accuracy": accuracy, "bytes_per_step": strategy.bytes_per_step,
                         "params": params_of(model)}
    return results
