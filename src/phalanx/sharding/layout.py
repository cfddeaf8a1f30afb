"""Sharded state: shard within a replica group with FSDP2, let a phalanx strategy agree across groups.

A job of N workers is R replica groups x S shards (``R = N // S``), a 2-D
``DeviceMesh`` with dims ("replicate", "shard") that :meth:`phalanx.group.group.Group.mesh`
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

The batch weight (:mod:`phalanx.step.clock`) holds under FSDP too: FSDP moves gradients
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
from typing import TYPE_CHECKING, Any, Callable, Protocol, runtime_checkable

import torch
from torch import nn
from torch.utils._pytree import tree_map_only

from ..step import _engine
from .. import check
from ..group.collectives import Comm, local_shard
from ..errors import ConfigError, usage
from ..strategies import AllReduce, Strategy
from ..strategies.base import ServerBacked, check_same_model

if TYPE_CHECKING:
    from ..group.group import Group
    from ..step.clock import StepClock


@runtime_checkable
class OnShards(Protocol):
    """A rule that can work on each rank's shard of the parameters (``px.wrap(..., shard=...)``).

    Where ``on_shards()`` is True it exchanges the shards (never their gradients) with the same shard
    of the other replica groups, over the mesh's "replicate" group. Every ``px.Periodic`` rule does;
    a rule without this method runs on shards only as HSDP (``px.AllReduce()``).
    """

    def on_shards(self) -> bool: ...


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
        self.shard_size = self.group_size  # S of the current layout: a regroup may change it (reshard)
        self._output: _OutputHook | None = None
        self._output_handle: Any = None

    # -- refusals ----------------------------------------------------------------------------------------------
    def check(self, g: "Group", strategy: Strategy) -> None:
        """Refuse, in one line, a layout or strategy that cannot run on shards."""
        s, n = self.group_size, g.world_size
        if n % s and not g.entering:  # a joiner enters whatever layout the job has now (see reshard)
            raise ConfigError(usage(f"FullyShard(group_size={s}) with {n} workers",
                                    f"a group size that divides the world size ({_divisors(n)})",
                                    f"Pick one of those, or start a multiple of {s} workers."))
        if isinstance(strategy, ServerBacked):
            raise ConfigError(usage(f"shard=FullyShard(...) with {type(strategy).__name__}",
                                    "a strategy that agrees between workers (AllReduce, LocalSGD, DiLoCo, EASGD): a "
                                    "parameter server holds the whole model", "Drop shard=, or use px.DiLoCo."))
        if not (hsdp(strategy) or (isinstance(strategy, OnShards) and strategy.on_shards())):
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
        strategy.sharded_by = self  # phalanx.elastic finds it there to re-shard after a regroup
        if g.entering:
            return model  # a joiner of an elastic job: sharded when it enters, from the members' shards (reshard)
        whole = Comm()
        check_same_model(model, whole)
        whole.broadcast_([t.data for t in model.state_dict(keep_vars=True).values()])
        self.shard_over(model, optimizer, strategy, g, self.group_size)
        return model

    def shard_over(self, model: nn.Module, optimizer: torch.optim.Optimizer, strategy: Strategy, g: "Group",
                   size: int, fill: Callable[[nn.Module], None] | None = None) -> None:
        """``fully_shard`` ``model`` over shards of ``size``; the optimizer follows.

        ``model`` holds whole plain tensors, or (a reshard) parameters on the meta device that
        ``fill(model)`` gives their local shards once FSDP has laid them out.
        """
        # FSDP is imported by the jobs that shard only: with DTensor it costs 1.1 s of every worker's start-up.
        from torch.distributed.fsdp import fully_shard

        mesh = g.mesh(size)
        names = {id(p): name for name, p in model.named_parameters()}
        dp_mesh = mesh if hsdp(strategy) else mesh["shard"]
        for sub in _units(model, self.min_params):
            fully_shard(sub, mesh=dp_mesh)
        fully_shard(model, mesh=dp_mesh)
        if fill is not None:
            fill(model)
        new = dict(model.named_parameters())
        for pg in optimizer.param_groups:
            pg["params"] = [new[names[id(p)]] for p in pg["params"]]
        # A periodic rule's exchanges go to the same shard of the other replica groups; under HSDP FSDP itself
        # averages over the whole mesh, and the strategy's comm only serves its start-up checks.
        strategy.comm = Comm(process_group=mesh["replicate"].get_group())
        strategy.params = [local_shard(p) for p in model.parameters() if p.requires_grad]
        self.shard_size = size

    def rehook(self, model: nn.Module, g: "Group", size: int) -> None:
        """After :func:`~.reshard.reshard` laid ``model`` out anew over shards of ``size``: the batch-weight
        hook goes behind FSDP's new forward hook again, and rank 0 says when ``group_size`` could not be kept."""
        if self._output is not None:  # behind FSDP's new forward hook again, as at px.wrap
            if self._output_handle is not None:
                self._output_handle.remove()
            self._output_handle = model.register_forward_hook(self._output)
        if g.rank == 0 and size != self.group_size:
            print(f"phalanx: sharded: {g.world_size} workers re-shard as 1 x {size} (FSDP over all of them): "
                  f"group_size={self.group_size} does not divide {g.world_size}", file=sys.stderr, flush=True)

    def hook(self, model: nn.Module, clock: "StepClock") -> None:
        """Weigh the gradient by the batch weight and announce the end of backward (after FSDP's own)."""
        self._output = _OutputHook(clock)
        if is_sharded(model):  # a joiner's model is sharded when it enters: reshard registers it then
            self._output_handle = model.register_forward_hook(self._output)

    def __repr__(self) -> str:
        extra = "" if self.min_params == 1_000_000 else f", min_params={self.min_params}"
        return f"FullyShard(group_size={self.group_size}{extra})"


def sharded_by(optimizer: torch.optim.Optimizer | None) -> "FullyShard | None":
    """The :class:`FullyShard` that ``px.wrap`` applied to the model of ``optimizer``, if any."""
    return getattr(getattr(optimizer, "_phalanx_strategy", None), "sharded_by", None)


def hsdp(strategy: Strategy) -> bool:
    """True for the strategy that sharding turns into HSDP: gradient averaging with no compressor."""
    return isinstance(strategy, AllReduce) and strategy.compression is None


def _divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)


def _units(model: nn.Module, min_params: int) -> list[nn.Module]:
    """Submodules (post-order, the root excluded) with at least ``min_params`` parameters not in a smaller unit.

    A submodule sharing a parameter with a module outside it (tied weights: a GPT's token embedding reused as
    its output layer) is never a unit: FSDP2 would shard the parameter in one unit and the other module would
    meet a DTensor beside plain tensors ("aten.mm got mixed torch.Tensor and DTensor"). Its parameters go to
    the smallest enclosing unit that holds every module using them.
    """
    owners: dict[int, list[nn.Module]] = {}
    for m in model.modules():
        for p in m._parameters.values():  # the same Parameter object in two modules: tied
            if p is not None:
                owners.setdefault(id(p), []).append(m)
    units: list[nn.Module] = []

    def walk(m: nn.Module) -> int:
        free = sum(walk(c) for c in m.children()) + sum(p.numel() for p in m.parameters(recurse=False))
        if m is not model and free >= min_params:
            inside = {id(x) for x in m.modules()}
            if all(id(o) in inside for p in m.parameters() for o in owners[id(p)]):
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
        weighs = self.clock.weighs_gradients(self.clock.step + 1)
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


__all__ = ["FullyShard", "OnShards", "hsdp", "is_sharded", "sharded_by"]
