"""The setups compared side by side: torch's own (DDP, its hooks, post-local SGD) and phalanx's.

Every setup gets the task's optimizer family (AdamW for the GPT, SGD with momentum for
ResNet-20) except DiLoCo, whose inner optimizer is AdamW on both tasks, as in the
paper. Periods are the papers' where they fit the budget: local SGD H = 16 (Lin et al.
2020) with a 50-step synchronous warm-up for the post-local variants (the same on both
sides), DiLoCo H = 50 (the paper's smallest), EASGD τ = 4, Downpour push/pull every step
with Adagrad on the servers (Dean et al.), its lr swept from the SGD base.

Example:
    >>> sorted(SETUPS)[:3], SETUPS["diloco"].optim
    (['allreduce', 'ddp', 'ddp-fp16'], 'adamw')
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn

from ..spec import Setup
from ..worker import _PeerAccountant, _StrategyAccountant, setup_training

WARMUP, LOCAL_EVERY, DILOCO_EVERY = 50, 16, 50


@dataclass(frozen=True)
class QSetup:
    """One side-by-side entry: who provides it, how it is built, which optimizer family it uses."""

    name: str
    provider: str  # "torch" or "phalanx"
    build: Callable[[nn.Module, torch.optim.Optimizer, float], tuple[nn.Module, torch.optim.Optimizer, Any]]
    optim: str | None = None  # None: the task's family; "adamw": always AdamW (DiLoCo)
    note: str = field(default="")


def _peer(name: str, **kwargs: Any):
    def build(model, opt, lr):
        module, acc = setup_training(Setup(name, kwargs), model, opt)
        return module, opt, acc
    return build


def _phalanx(make: Callable[[float], Any]):
    def build(model, opt, lr):
        import phalanx as px

        px.init()
        strategy = make(lr)
        module, opt2 = px.wrap(model, opt, strategy=strategy)
        return module, opt2, _StrategyAccountant(strategy)
    return build


def _torch_post_local(model, opt, lr):
    """PyTorch's post-local SGD: DDP with post_localSGD_hook, then PostLocalSGDOptimizer + PeriodicModelAverager."""
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import post_localSGD_hook as plh
    from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager
    from torch.distributed.optim import PostLocalSGDOptimizer
    from torch.nn.parallel import DistributedDataParallel as DDP

    if not dist.is_initialized():
        dist.init_process_group("gloo")
    ddp = DDP(model)
    # subgroup=None would make torch split the world into per-GPU-count subgroups, which it refuses without CUDA;
    # the whole world is the group local SGD averages over here.
    state = plh.PostLocalSGDState(process_group=None, subgroup=dist.group.WORLD, start_localSGD_iter=WARMUP)
    ddp.register_comm_hook(state, plh.post_localSGD_hook)
    averager = PeriodicModelAverager(period=LOCAL_EVERY, warmup_steps=WARMUP)
    wrapped = PostLocalSGDOptimizer(optim=opt, averager=averager)
    acc = _PostLocalAccountant(sum(p.numel() * p.element_size() for p in model.parameters()))
    wrapped.optim.register_step_post_hook(acc.count_step)
    return ddp, wrapped, acc


class _PostLocalAccountant(_PeerAccountant):
    """Counted bytes: the gradient every step during the warm-up, then the parameters every LOCAL_EVERY steps."""

    def bytes_sent(self) -> float:
        warm = min(self.steps, WARMUP)
        later = max(0, self.steps - WARMUP) // LOCAL_EVERY
        return float(self.grad_bytes * (warm + later))


def _make() -> dict[str, QSetup]:
    import phalanx as px
    from phalanx.ps.optim import Adagrad

    s = [
        QSetup("ddp", "torch", _peer("ddp")),
        QSetup("ddp-fp16", "torch", _peer("ddp-fp16")),
        QSetup("ddp-powersgd", "torch", _peer("ddp-powersgd", rank=4)),
        QSetup("torch-post-local-sgd", "torch", _torch_post_local,
               note=f"PostLocalSGDOptimizer + PeriodicModelAverager(period={LOCAL_EVERY}, warmup_steps={WARMUP})"),
        QSetup("allreduce", "phalanx", _phalanx(lambda lr: px.AllReduce())),
        QSetup("fp16", "phalanx", _phalanx(lambda lr: px.AllReduce(compression=px.FP16()))),
        QSetup("powersgd", "phalanx", _phalanx(lambda lr: px.AllReduce(compression=px.PowerSGD(rank=4)))),
        QSetup("topk", "phalanx", _phalanx(lambda lr: px.AllReduce(compression=px.TopK(0.01)))),
        QSetup("local-sgd", "phalanx", _phalanx(lambda lr: px.LocalSGD(every=LOCAL_EVERY))),
        QSetup("post-local-sgd", "phalanx",
               _phalanx(lambda lr: px.LocalSGD(every=LOCAL_EVERY, warmup_steps=WARMUP))),
        QSetup("diloco", "phalanx", _phalanx(lambda lr: px.DiLoCo(every=DILOCO_EVERY)), optim="adamw",
               note=f"H={DILOCO_EVERY}, AdamW inner, Nesterov outer lr 0.7 momentum 0.9"),
        QSetup("easgd", "phalanx", _phalanx(lambda lr: px.EASGD(every=4))),
        QSetup("downpour", "phalanx", _phalanx(lambda lr: px.Downpour(server_optimizer=Adagrad(lr))), optim="sgd",
               note="push/pull every step; Adagrad on the servers at the swept lr (from the SGD base lr)"),
    ]
    return {q.name: q for q in s}


SETUPS: dict[str, QSetup] = _make()
PEER_REASONS = {
    "torchft-diloco": "torchft 0.2.0 installs beside torch 2.13 in its own environment (benchmarks/torchft/setup.sh) "
                      "and its DiLoCo (lighthouse + one Manager per replica group, gloo) trains this benchmark's "
                      "GPT with 2 replicas on loopback (benchmarks/torchft/diloco_peer.py); it is not yet a setup "
                      "of this run: its replicas would have to reach the lighthouse from inside the shaped links' "
                      "network namespaces, and its byte and time accounting be joined to these tables",
}
