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
import warnings
from typing import TYPE_CHECKING, Any, Callable, Protocol, Union, runtime_checkable

import torch
from torch import nn
from torch.utils._pytree import tree_map_only

from ..step import _engine
from .. import check
from ..group.collectives import Comm, local_shard
from ..errors import ConfigError, usage
from ..strategies import AllReduce, Strategy
from ..strategies.base import ServerBacked, check_same_model
from .meta import _materialise, initialiser, on_meta

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
            world size. 1 shards nothing. S equal to the world size is plain FSDP: one group,
            parameters on a 1-D mesh placed ``(Shard(0),)``; a smaller S is HSDP, a 2-D mesh
            placed ``(Replicate(), Shard(0))``.
        min_params: a submodule holding at least this many parameters (not already in a
            smaller unit) becomes its own FSDP unit, so that only one unit's full weights
            are gathered at a time; the root module takes the rest. Default 1,000,000.
        units: instead of ``min_params``, the units as FSDP2 users choose them: a class (or a
            tuple of classes) whose every submodule becomes a unit (one per transformer block),
            or a function ``module -> bool``. The root module takes the rest.
        mp_policy: mixed precision, torch's own ``torch.distributed.fsdp.MixedPrecisionPolicy``
            (``param_dtype`` for the gathered parameters and the forward/backward,
            ``reduce_dtype`` for the gradient reduction, ``output_dtype`` for the outputs); the
            sharded parameters and the optimizer stay in their own dtype.

    Pass it to ``px.wrap(model, opt, strategy=..., shard=px.FullyShard(group_size=2))``.
    The optimizer must be fresh (not stepped yet): FSDP replaces the parameters with
    sharded ones, and ``px.wrap`` points the optimizer's parameter groups at them. A model
    built on the meta device (``with torch.device("meta"):``) is sharded first, then each
    worker allocates its own shards and the model's ``init_weights()`` / ``reset_parameters()``
    fill them (:meth:`apply`): no worker ever holds the whole model.

    Example:
        >>> import torch, phalanx as px
        >>> from torch.distributed.fsdp import MixedPrecisionPolicy
        >>> px.FullyShard(group_size=2, units=torch.nn.TransformerEncoderLayer)
        FullyShard(group_size=2, units=TransformerEncoderLayer)
        >>> bf16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        >>> px.FullyShard(group_size=2, mp_policy=bf16)
        FullyShard(group_size=2, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
    """

    def __init__(self, group_size: int, *, min_params: int | None = None, units: "Units | None" = None,
                 mp_policy: Any = None) -> None:
        self.group_size = check.positive_int("FullyShard(group_size", group_size,
                                        "Pass how many workers share one replica, e.g. group_size=2.",
                                        close=")")
        if units is not None and min_params is not None:
            raise ConfigError(usage(f"FullyShard(min_params={min_params!r}, units={_describe(units)})",
                                    "one way to choose the FSDP units", "Pass units= (by module) or min_params= "
                                    "(by parameter count), not both."))
        self.min_params = 1_000_000 if min_params is None else check.positive_int(
            "FullyShard(min_params", min_params, "Pass a parameter count, e.g. min_params=1_000_000.", close=")")
        self.units = _unit_rule(units)
        self.mp_policy = _policy(mp_policy)
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
                                    "EASGD, StreamingDiLoCo with whole-tensor fragments and without quantize= or "
                                    "SparseLoCo)",
                                    "Use one of those, or drop shard=."))

    # -- sharding ------------------------------------------------------------------------------------------------
    def apply(self, model: nn.Module, optimizer: torch.optim.Optimizer, strategy: Strategy,
              g: "Group") -> nn.Module:
        """Shard ``model`` in place, point ``optimizer`` at the sharded parameters, give ``strategy`` its group.

        Collective over every worker. A model with real weights: rank 0's are broadcast first,
        while the model is whole, so every shard starts from the same model whatever the workers'
        seeds. A model on the meta device: ``fully_shard`` lays it out, each worker allocates its
        own shards (``to_empty``) and the model's own ``init_weights()`` / ``reset_parameters()``
        fills them, drawing from rank 0's random state, as torch's FSDP2 programs do
        (:func:`initialiser`): every replica agrees, and no worker holds more than its shards.
        """
        if any(optimizer.state.values()):
            raise ConfigError(usage("an optimizer that has already stepped, with shard=",
                                    "a fresh optimizer (FSDP replaces the parameters with sharded ones)",
                                    "Build the optimizer, then call px.wrap before the first step."))
        _units(model, self.min_params, self.units)  # a unit class that matches nothing: refused before anything else
        init = initialiser(model) if on_meta(model) else None
        if g.world_size == 1 and self.group_size == 1:
            if init is not None:
                _materialise(model, init, g.device)
            if self.mp_policy is not None:
                warnings.warn("FullyShard(mp_policy=...) in a group of one with group_size=1 leaves the model as it "
                              "is (plain PyTorch, in its own dtype); on one worker use torch.autocast", stacklevel=3)
            return model  # nothing to shard, nobody to agree with: plain PyTorch
        strategy.sharded_by = self  # phalanx.elastic finds it there to re-shard after a regroup
        if g.entering:
            return model  # a joiner of an elastic job: sharded when it enters, from the members' shards (reshard)
        whole = Comm()
        check_same_model(model, whole, device=g.device)
        if init is None:
            whole.broadcast_([t.data for t in model.state_dict(keep_vars=True).values()])
        self.shard_over(model, optimizer, strategy, g, self.group_size,
                        fill=None if init is None else lambda m: _materialise(m, init, g.device))
        return model

    def shard_over(self, model: nn.Module, optimizer: torch.optim.Optimizer, strategy: Strategy, g: "Group",
                   size: int, fill: Callable[[nn.Module], None] | None = None) -> None:
        """``fully_shard`` ``model`` over shards of ``size``; the optimizer follows.

        ``model`` holds whole plain tensors, or parameters on the meta device that ``fill(model)``
        gives their local shards once FSDP has laid them out (a reshard; a model built on the meta
        device). One group of every worker is plain FSDP on the mesh's 1-D "shard" dimension
        (placements ``(Shard(0),)``); HSDP takes the whole 2-D mesh.
        """
        # FSDP is imported by the jobs that shard only: with DTensor it costs 1.1 s of every worker's start-up.
        from torch.distributed.fsdp import fully_shard

        mesh = g.mesh(size)
        names = {id(p): name for name, p in model.named_parameters()}
        dp_mesh = mesh if hsdp(strategy) and size < g.world_size else mesh["shard"]
        options: dict[str, Any] = {"mesh": dp_mesh}
        if self.mp_policy is not None:
            options["mp_policy"] = self.mp_policy
        for sub in _units(model, self.min_params, self.units):
            fully_shard(sub, **options)
        fully_shard(model, **options)
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
        extra = "" if self.min_params == 1_000_000 or self.units is not None else f", min_params={self.min_params}"
        if self.units is not None:
            extra += f", units={_describe(self.units)}"
        if self.mp_policy is not None:
            fields = ", ".join(f"{k}={getattr(self.mp_policy, k)}" for k in ("param_dtype", "reduce_dtype",
                               "output_dtype") if getattr(self.mp_policy, k) is not None)
            if not self.mp_policy.cast_forward_inputs:
                fields += ", cast_forward_inputs=False" if fields else "cast_forward_inputs=False"
            extra += f", mp_policy=MixedPrecisionPolicy({fields})"
        return f"FullyShard(group_size={self.group_size}{extra})"


def sharded_by(optimizer: torch.optim.Optimizer | None) -> "FullyShard | None":
    """The :class:`FullyShard` that ``px.wrap`` applied to the model of ``optimizer``, if any."""
    return getattr(getattr(optimizer, "_phalanx_strategy", None), "sharded_by", None)


def hsdp(strategy: Strategy) -> bool:
    """True for the strategy that sharding turns into HSDP: gradient averaging with no compressor."""
    return isinstance(strategy, AllReduce) and strategy.compression is None


def _divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)


Units = Union[type, tuple[type, ...], Callable[[nn.Module], bool]]
"""What ``FullyShard(units=...)`` takes: a module class, a tuple of them, or a function ``module -> bool``."""

# The dtypes FSDP can gather and reduce in on gloo (CPU) and NCCL: gloo's reductions take no other floating dtype.
REDUCIBLE = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def _unit_rule(units: Any) -> "Units | None":
    """``units`` as given, checked: None, a tuple of nn.Module classes, or a function that is not a class."""
    if units is None:
        return None
    classes = tuple(units) if isinstance(units, (tuple, list, set, frozenset)) else (units,)
    if all(isinstance(c, type) and issubclass(c, nn.Module) for c in classes) and classes:
        return classes
    if not isinstance(units, type) and callable(units):
        return units
    raise ConfigError(usage(f"FullyShard(units={units!r})", "a module class (e.g. your transformer block), a tuple "
                            "of them, or a function module -> bool", "Pass e.g. units=TransformerBlock."))


def _describe(units: Any) -> str:
    if isinstance(units, type):
        return units.__name__
    if isinstance(units, tuple) and all(isinstance(c, type) for c in units):
        return units[0].__name__ if len(units) == 1 else "(" + ", ".join(c.__name__ for c in units) + ")"
    return getattr(units, "__name__", repr(units))


def _policy(policy: Any) -> Any:
    """``mp_policy`` checked: torch's ``MixedPrecisionPolicy`` whose dtypes FSDP can gather and reduce in."""
    if policy is None:
        return None
    from torch.distributed.fsdp import MixedPrecisionPolicy  # the user imported it to build ``policy``

    if not isinstance(policy, MixedPrecisionPolicy):
        raise ConfigError(usage(f"FullyShard(mp_policy={policy!r})", "a torch.distributed.fsdp.MixedPrecisionPolicy",
                                "Pass e.g. mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, "
                                "reduce_dtype=torch.float32)."))
    for field in ("param_dtype", "reduce_dtype", "output_dtype"):
        dtype = getattr(policy, field)
        if dtype is not None and dtype not in REDUCIBLE:
            raise ConfigError(usage(
                f"FullyShard(mp_policy=MixedPrecisionPolicy({field}={dtype}))",
                f"None or a dtype the workers can compute and reduce gradients in ({', '.join(map(str, REDUCIBLE))}: "
                "gloo and NCCL reduce no other)", f"Use e.g. {field}=torch.float32, or leave it None."))
    return policy


def _units(model: nn.Module, min_params: int, rule: "Units | None" = None) -> list[nn.Module]:
    """The FSDP units of ``model`` (post-order, the root excluded): the submodules ``rule`` picks (:func:`_chosen`),
    else those with at least ``min_params`` parameters not in a smaller unit.

    A submodule sharing a parameter with a module outside it (tied weights: a GPT's token embedding reused as
    its output layer) is never a unit by size: FSDP2 would shard the parameter in one unit and the other module
    would meet a DTensor beside plain tensors ("aten.mm got mixed torch.Tensor and DTensor"). Its parameters go to
    the smallest enclosing unit that holds every module using them.
    """
    owners: dict[int, list[nn.Module]] = {}
    for m in model.modules():
        for p in m._parameters.values():  # the same Parameter object in two modules: tied
            if p is not None:
                owners.setdefault(id(p), []).append(m)

    def closed(m: nn.Module) -> bool:  # every module using m's parameters is inside m
        inside = {id(x) for x in m.modules()}
        return all(id(o) in inside for p in m.parameters() for o in owners[id(p)])

    if rule is not None:
        return _chosen(model, rule, closed)
    units: list[nn.Module] = []

    def walk(m: nn.Module) -> int:
        free = sum(walk(c) for c in m.children()) + sum(p.numel() for p in m.parameters(recurse=False))
        if m is not model and free >= min_params and closed(m):
            units.append(m)
            return 0
        return free

    walk(model)
    return units


def _chosen(model: nn.Module, rule: "Units", closed: Callable[[nn.Module], bool]) -> list[nn.Module]:
    """The submodules ``rule`` picks (post-order, as FSDP2 wants an inner unit sharded before its outer one).

    Refused in one line: a class of ``rule`` that matches no submodule, a function that picks none, a picked
    module whose parameter a module outside it also uses (tied weights: FSDP2 cannot shard it in one unit only).
    """
    order: list[nn.Module] = []
    seen: set[int] = set()

    def walk(m: nn.Module) -> None:
        for c in m.children():
            if id(c) not in seen:
                seen.add(id(c))
                walk(c)
                order.append(c)

    walk(model)
    picks = (lambda m: isinstance(m, rule)) if isinstance(rule, tuple) else rule
    units = [m for m in order if picks(m)]
    found = sorted({type(m).__name__ for m in order})
    if isinstance(rule, tuple):
        missing = [c.__name__ for c in rule if not any(isinstance(m, c) for m in order)]
        if missing:
            raise ConfigError(usage(f"FullyShard(units={_describe(rule)}): no submodule of the "
                                    f"{type(model).__name__} is a {' or '.join(missing)}",
                                    f"classes of its submodules (it has {', '.join(found) or 'none'})",
                                    "Pass the class of its repeated block, e.g. units=TransformerBlock."))
    elif not units:
        raise ConfigError(usage(f"FullyShard(units={_describe(rule)}), which picked no submodule of the "
                                f"{type(model).__name__}", "a function that returns True for each unit (one per "
                                f"block), its submodules being {', '.join(found) or 'none'}",
                                "Fix the function, or pass a class: units=TransformerBlock."))
    names = {id(m): name for name, m in model.named_modules()}
    for m in units:
        if not closed(m):
            raise ConfigError(usage(f"FullyShard(units={_describe(rule)}) picking {names[id(m)]!r} "
                                    f"({type(m).__name__}), whose parameters a module outside it also uses (tied "
                                    "weights)", "units that hold every module using their parameters",
                                    "Pick the module that encloses both users, or untie the weights."))
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


__all__ = ["FullyShard", "OnShards", "Units", "hsdp", "is_sharded", "sharded_by"]
