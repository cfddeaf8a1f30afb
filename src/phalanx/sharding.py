"""Sharded state: shard within a replica group with FSDP2, let a phalanx strategy agree across groups.

A job of N workers is R replica groups x S shards (``R = N // S``), a 2-D
``DeviceMesh`` with dims ("replicate", "shard") that :meth:`phalanx.group.Group.mesh`
builds once per generation. Rank ``r * S + s`` holds shard ``s`` of replica group ``r``.
Inside a group torch's ``fully_shard`` (FSDP2, ZeRO-3) shards parameters, gradients
and optimizer state, and averages the group's gradients (reduce-scatter). Across
groups the strategy decides:

* ``px.AllReduce()`` is HSDP: ``fully_shard`` on the whole 2-D mesh, so the gradient is
  averaged over all N workers (with R = 1, plain FSDP);
* a :class:`~phalanx.strategies.base.Periodic` rule (``LocalSGD``, ``DiLoCo``, ``EASGD``, a
  compressor inside DiLoCo) runs on this rank's shard of the parameters, over the mesh's
  "replicate" process group: each rank exchanges only its shard with the same shard of
  the other groups, so its bytes per exchange fall by S.

The batch weight (:mod:`phalanx.steps`) holds under FSDP too: FSDP moves gradients
outside autograd's accumulation, so instead of a per-parameter hook the gradient that
flows back into the model's outputs is scaled by this worker's share of the batch,
before any reduce-scatter.

Example (a group of one, where ``group_size=1`` leaves the model as it is):
    >>> import torch, phalanx as px
    >>> net = torch.nn.Linear(4, 2)
    >>> model, opt = px.wrap(net, torch.optim.AdamW(net.parameters()), shard=px.FullyShard(group_size=1))
    >>> px.FullyShard(group_size=2)
    FullyShard(group_size=2)
"""
from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils._pytree import tree_map_only

from . import _engine, check
from .comm import Comm
from .errors import ConfigError, usage
from .strategies import AllReduce, Strategy
from .strategies.base import check_same_model

if TYPE_CHECKING:
    from .group import Group
    from .steps import StepClock


class FullyShard:
    """Shard parameters, gradients and optimizer state over groups of ``group_size`` workers (FSDP2).

    Args:
        group_size: S, the workers that share one replica of the model; it must divide the
            world size. 1 shards nothing.
        min_params: a submodule holding at least this many parameters (not already in a
            smaller unit) becomes its own FSDP unit, so that only one unit's full weights
            are gathered at a time; the root module takes the rest.

    Pass it to ``px.wrap(model, opt, strategy=..., shard=px.FullyShard(group_size=2))``.
    The optimizer must be fresh (not stepped yet): FSDP replaces the parameters with
    sharded ones, and ``px.wrap`` points the optimizer's parameter groups at them.
    """

    def __init__(self, group_size: int, *, min_params: int = 1_000_000) -> None:
        self.group_size = check.positive_int("FullyShard(group_size", group_size,
                                        "Pass how many workers share one replica, e.g. group_size=2.",
                                        close=")")
        self.min_params = check.positive_int("FullyShard(min_params", min_params,
                                        "Pass a parameter count, e.g. min_params=1_000_000.", close=")")

    # -- refusals ----------------------------------------------------------------------------------------------
    def check(self, g: "Group", strategy: Strategy) -> None:
        """Refuse, in one line, a layout or strategy that cannot run on shards."""
        s, n = self.group_size, g.world_size
        if n % s:
            raise ConfigError(usage(f"FullyShard(group_size={s}) with {n} workers",
                                    f"a group size that divides the world size ({_divisors(n)})",
                                    f"Pick one of those, or start a multiple of {s} workers."))
        if g.elastic:
            raise ConfigError(usage(f"shard=FullyShard(group_size={s}) under `phalanx run --elastic`",
                                    "a fixed worker group (a lost worker would take its shard with it)",
                                    "Drop --elastic, or drop shard= to keep a full replica on every worker."))
        if strategy.uses_servers:
            raise ConfigError(usage(f"shard=FullyShard(...) with {type(strategy).__name__}",
                                    "a strategy that agrees between workers (AllReduce, LocalSGD, DiLoCo, EASGD): a "
                                    "parameter server holds the whole model", "Drop shard=, or use px.DiLoCo."))
        if not (hsdp(strategy) or strategy.on_shards()):
            raise ConfigError(usage(f"shard=FullyShard(...) with {strategy!r}",
                                    "px.AllReduce() without compression (HSDP), or a periodic rule that exchanges "
                                    "parameters (LocalSGD without warm-up, DiLoCo with or without a compressor, "
                                    "EASGD)", "Use one of those, or drop shard=."))

    # -- sharding ------------------------------------------------------------------------------------------------
    def apply(self, model: nn.Module, optimizer: torch.optim.Optimizer, strategy: Strategy,
              g: "Group") -> nn.Module:
        """Shard ``model`` in place, point ``optimizer`` at the sharded parameters, give ``strategy`` its group.

        Collective over every worker. Rank 0's weights are broadcast first, while the model is
        whole, so every shard starts from the same model whatever the workers' seeds.
        """
        if any(optimizer.state.values()):
            raise ConfigError(usage("an optimizer that has already stepped, with shard=",
                                    "a fresh optimizer (FSDP replaces the parameters with sharded ones)",
                                    "Build the optimizer, then call px.wrap before the first step."))
        if g.world_size == 1 and self.group_size == 1:
            return model  # nothing to shard, nobody to agree with: plain PyTorch
        # FSDP is imported by the jobs that shard only: with DTensor it costs 1.1 s of every worker's start-up.
        from torch.distributed.fsdp import fully_shard

        whole = Comm()
        check_same_model(model, whole)
        whole.broadcast_([t.data for t in model.state_dict(keep_vars=True).values()])
        mesh = g.mesh(self.group_size)
        names = {id(p): name for name, p in model.named_parameters()}
        dp_mesh = mesh if hsdp(strategy) else mesh["shard"]
        for sub in _units(model, self.min_params):
            fully_shard(sub, mesh=dp_mesh)
        fully_shard(model, mesh=dp_mesh)
        new = dict(model.named_parameters())
        for pg in optimizer.param_groups:
            pg["params"] = [new[names[id(p)]] for p in pg["params"]]
        # A periodic rule's exchanges go to the same shard of the other replica groups; under HSDP FSDP itself
        # averages over the whole mesh, and the strategy's comm only serves its start-up checks.
        strategy.comm = Comm(process_group=mesh["replicate"].get_group())
        return model

    def hook(self, model: nn.Module, clock: "StepClock") -> None:
        """Weigh the gradient by the batch weight and announce the end of backward (after FSDP's own)."""
        if is_sharded(model):
            model.register_forward_hook(_OutputHook(clock))

    def __repr__(self) -> str:
        extra = "" if self.min_params == 1_000_000 else f", min_params={self.min_params}"
        return f"FullyShard(group_size={self.group_size}{extra})"


def hsdp(strategy: Strategy) -> bool:
    """True for the strategy that sharding turns into HSDP: gradient averaging with no compressor."""
    return isinstance(strategy, AllReduce) and strategy.compression is None


def _divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)


def _units(model: nn.Module, min_params: int) -> list[nn.Module]:
    """Submodules (post-order, the root excluded) with at least ``min_params`` parameters not in a smaller unit."""
    units: list[nn.Module] = []

    def walk(m: nn.Module) -> int:
        free = sum(walk(c) for c in m.children()) + sum(p.numel() for p in m.parameters(recurse=False))
        if m is not model and free >= min_params:
            units.append(m)
            return 0
        return free

    walk(model)
    return units


def is_sharded(model: nn.Module) -> bool:
    """True for a model ``px.wrap(..., shard=...)`` sharded (its parameters are DTensors)."""
    fsdp = sys.modules.get("torch.distributed.fsdp")  # no model is sharded before FSDP is imported
    return fsdp is not None and isinstance(model, fsdp.FSDPModule)


class _Scale(torch.autograd.Function):
    """Identity forward; backward scales the gradient by the batch weight and tells the step clock."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: float | None, hook: "_OutputHook") -> torch.Tensor:
        ctx.weight, ctx.hook = weight, hook
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, None, None]:
        ctx.hook.backward_began()
        w = ctx.weight
        if w is None or w == 1.0:
            return grad, None, None
        return (torch.zeros_like(grad) if w == 0 else grad * w), None, None  # an empty part's gradient may be NaN


class _OutputHook:
    """Forward hook on the sharded root: its outputs carry the batch weight back into backward."""

    def __init__(self, clock: "StepClock") -> None:
        self.clock = clock
        self.queued = False

    def __call__(self, module: nn.Module, args: Any, output: Any) -> Any:
        strategy = self.clock.strategy
        weighs = strategy is not None and strategy.weighs_gradients(self.clock.step + 1)
        weight = self.clock.weight if weighs else None
        return tree_map_only(torch.Tensor, lambda t: _Scale.apply(t, weight, self)
                             if t.requires_grad and t.is_floating_point() else t, output)

    def backward_began(self) -> None:
        # Queued now, this runs first at the end of the pass and queues the clock's callback again, behind FSDP's
        # own final callback (queued by FSDP's pre-backward hook, which fires just after this): the sharded
        # gradients are in .grad by then.
        if self.queued or not self.clock.syncing():
            return
        self.queued = True
        _engine.queue_callback(lambda: _engine.queue_callback(self._fire))

    def _fire(self) -> None:
        self.queued = False
        self.clock.backward.callback()


__all__ = ["FullyShard", "is_sharded"]
