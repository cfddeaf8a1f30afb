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
from typing import TYPE_CHECKING, Any, Callable

import torch
from torch import nn
from torch.utils._pytree import tree_map_only

from . import _engine, check
from .comm import Comm, all_gather_object, broadcast_object, local_shard
from .errors import ConfigError, PhalanxError, usage
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
        if g.elastic and not hsdp(strategy):
            raise ConfigError(usage(f"shard=FullyShard(group_size={s}) with {strategy!r} under `phalanx run "
                                    "--elastic`", "px.AllReduce() (HSDP): a regroup re-shards its state onto the "
                                    "survivors", "Use px.AllReduce(), drop --elastic, or drop shard=."))
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
        strategy.sharded_by = self  # phalanx.elastic finds it there to re-shard after a regroup
        if g.entering:
            return model  # a joiner of an elastic job: sharded when it enters, from the members' shards (reshard)
        whole = Comm()
        check_same_model(model, whole)
        whole.broadcast_([t.data for t in model.state_dict(keep_vars=True).values()])
        self._shard(model, optimizer, strategy, g, self.group_size)
        return model

    def _shard(self, model: nn.Module, optimizer: torch.optim.Optimizer, strategy: Strategy, g: "Group",
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

    # -- elastic: the commit as local parts, re-sharded onto a rebuilt group ------------------------------------
    def reshard(self, model: nn.Module, optimizer: torch.optim.Optimizer, strategy: Strategy, g: "Group",
                commit: dict[str, Any] | None) -> dict[str, int]:
        """After ``g`` was rebuilt: shard ``model`` over the new group from the commit the survivors hold.

        Collective over the new group. ``commit`` is this worker's (its ``model`` and ``optimizer``
        as :func:`local_parts`), or None for a worker that holds none (a joiner, a spare). Each
        worker receives, point to point, only the rows of its new shard that it does not hold
        already, each from the lowest rank that holds them (any surviving replica group holds every
        shard), and builds its new shard from them: no worker ever holds a whole tensor of the model
        or of the optimizer state (plain values, such as buffers, come whole from one holder). The
        new layout keeps ``group_size`` where it divides the new world size, and is one group of
        every worker (FSDP) otherwise. A part that only lost workers held (R = 1) raises
        :class:`ShardLostError`. Returns ``{"received_bytes": ..., "state_bytes": ...}``: the bytes
        of sharded state this worker received, and the size of the whole sharded state.
        """
        held = commit is not None and commit.get("model") is not None
        index, of = _coordinate(commit["model"]) if held else (None, None)
        everyone = all_gather_object((index, of), "who holds which shard of the commit")
        olds = {o for _, o in everyone if o is not None}
        if len(olds) != 1:
            raise ShardLostError(f"no surviving worker holds the sharded commit (held: {everyone}); resume from "
                                 "the newest checkpoint (px.load_checkpoint)")
        old = olds.pop()
        source = {}
        for r, (i, _) in enumerate(everyone):
            if i is not None:
                source.setdefault(i, r)
        lost = [i for i in range(old) if i not in source]
        if lost:
            what = f"shard {', '.join(map(str, lost))} of {old}"
            raise ShardLostError(f"{what} of the commit was held only by the lost worker(s) (one replica group: "
                                 "R = 1); resume from the newest checkpoint (px.load_checkpoint), or pass "
                                 "px.elastic.State(checkpoint=DIR) to have the survivors reload it", what)
        outline = broadcast_object(_outline(commit) if g.rank == source[0] else None, source[0],
                                   "the outline of the commit")
        size = self._size_on(g)
        move = _Move([i for i, _ in everyone], source, _shard_index(g.mesh(size)), size, g.rank)
        unique = {name for name, _ in model.named_parameters()}  # tied weights travel once, under one name
        mine = commit["model"] if held else {}
        rows = {name: move.rows(spec, mine.get(name)) for name, spec in outline["model"].items()
                if _is_part(spec) and name in unique}
        plain = {name: v for name, v in outline["model"].items() if not _is_part(v)}  # buffers: whole, replicated
        theirs = outline["optimizer"]["state"]
        mine_opt = commit["optimizer"]["state"] if held else {}
        opt_rows = {(key, name): move.rows(spec, mine_opt.get(key, {}).get(name))
                    for key, entries in theirs.items() for name, spec in entries.items() if _is_part(spec)}
        self._shard_anew(model, optimizer, strategy, g, size, rows.__getitem__, plain)
        params = [p for pg in optimizer.param_groups for p in pg["params"]]
        state = {key: {name: _dtensor_like(opt_rows[key, name], spec, params[int(key)]) if _is_part(spec) else spec
                       for name, spec in entries.items()} for key, entries in theirs.items()}
        optimizer.load_state_dict({"state": state, "param_groups": outline["optimizer"]["param_groups"]})
        parts = [*(v for k, v in outline["model"].items() if k in unique),
                 *(v for e in theirs.values() for v in e.values())]
        return {"received_bytes": move.comm.stats.bytes_received,
                "state_bytes": sum(_nbytes(v) for v in parts if _is_part(v))}

    def reshard_empty(self, model: nn.Module, optimizer: torch.optim.Optimizer, strategy: Strategy,
                      g: "Group") -> None:
        """Shard ``model`` over the new group with undefined values, for ``px.load_checkpoint`` to fill (DCP
        reshards a checkpoint onto the new layout): the fallback when :meth:`reshard` found a shard lost.
        Collective. Each worker allocates its new shards only."""
        size = self._size_on(g)
        index = _shard_index(g.mesh(size))[g.rank]
        shapes = {name: (list(p.shape), p.dtype) for name, p in model.named_parameters()}  # global shapes

        def room(name: str) -> torch.Tensor:
            shape, dtype = shapes[name]
            lo, hi = _rows(shape[0], size, index)
            return torch.empty([hi - lo, *shape[1:]], dtype=dtype)

        self._shard_anew(model, optimizer, strategy, g, size, room, {})

    def _size_on(self, g: "Group") -> int:
        """S of the layout after a regroup: ``group_size`` where it divides the world size, else every worker."""
        return self.group_size if g.world_size % self.group_size == 0 else g.world_size

    def _shard_anew(self, model: nn.Module, optimizer: torch.optim.Optimizer, strategy: Strategy, g: "Group",
                    size: int, rows: Callable[[str], torch.Tensor], plain: dict[str, Any]) -> None:
        """Take FSDP off ``model`` and shard it over ``g`` anew, in shards of ``size``.

        Collective. The parameters go to the meta device (shape and dtype, no storage), ``plain``
        values (buffers) are put whole, ``fully_shard`` lays the meta parameters out on the new
        mesh, and each parameter ``name`` then takes ``rows(name)``, its local shard on this rank.
        """
        from torch.distributed.tensor.debug import _clear_sharding_prop_cache

        names = {id(p): name for name, p in model.named_parameters()}
        _strip_fsdp(model)
        _to_meta(model)
        for name, value in plain.items():
            _put(model, name, value)
        meta = dict(model.named_parameters())
        for pg in optimizer.param_groups:
            pg["params"] = [meta[names[id(p)]] for p in pg["params"]]
        optimizer.state.clear()
        # DTensor caches its sharding decisions by mesh, and meshes of two generations with the same shape compare
        # equal: without this, the new parameters would come back on an earlier generation's mesh, with that
        # generation's coordinates (seen on torch 2.13: 2x2 -> 1x3 -> 2x2 gave rank 1 the shard of rank 2).
        _clear_sharding_prop_cache()
        self._shard(model, optimizer, strategy, g, size, fill=lambda m: _fill(m, rows, g.device))
        self._rehook(model, g, size)

    def _rehook(self, model: nn.Module, g: "Group", size: int) -> None:
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


class ShardLostError(PhalanxError):
    """A regroup found a shard of the in-memory commit that only lost workers held (one replica group)."""

    def __init__(self, text: str, lost: str = "a shard") -> None:
        super().__init__(text)
        self.lost = lost  # e.g. "shard 1 of 2"


def sharded_by(optimizer: torch.optim.Optimizer | None) -> "FullyShard | None":
    """The :class:`FullyShard` that ``px.wrap`` applied to the model of ``optimizer``, if any."""
    return getattr(getattr(optimizer, "_phalanx_strategy", None), "sharded_by", None)


def local_parts(obj: Any) -> Any:
    """``obj`` (nested state) with every DTensor replaced by this rank's part of it, as plain values.

    A part is ``{"part": local tensor, "index": s, "of": S, "shape": [...]}``: shard ``s`` of ``S``
    along dim 0 (FSDP's layout). It holds no reference to the mesh, whose process groups die
    with their generation, and loads weights-only.
    """
    dtensor = sys.modules.get("torch.distributed.tensor")
    if dtensor is not None and isinstance(obj, dtensor.DTensor):
        index, of = _shard_coordinate(obj)
        return {"part": obj.to_local().detach().clone(), "index": index, "of": of, "shape": list(obj.shape)}
    if isinstance(obj, dict):
        return type(obj)((k, local_parts(v)) for k, v in obj.items())
    if isinstance(obj, (list, tuple)):
        return type(obj)(local_parts(v) for v in obj)
    return obj


def _shard_coordinate(t: Any) -> tuple[int, int]:
    from torch.distributed.tensor import Shard  # loaded: t is a DTensor
    dims = [i for i, p in enumerate(t.placements) if isinstance(p, Shard)]
    if len(dims) != 1 or t.placements[dims[0]].dim != 0:
        raise ConfigError(usage(f"a tensor placed {t.placements}", "FSDP's layout: sharded along dim 0 over one "
                                "mesh dimension", "Shard the model with px.FullyShard only."))
    return int(t.device_mesh.get_coordinate()[dims[0]]), int(t.device_mesh.size(dims[0]))


def _is_part(v: Any) -> bool:
    return isinstance(v, dict) and "part" in v and "of" in v


def _coordinate(model_parts: dict[str, Any]) -> tuple[int | None, int | None]:
    for v in model_parts.values():
        if _is_part(v):
            return int(v["index"]), int(v["of"])
    return None, None


def _outline(commit: dict[str, Any]) -> dict[str, Any]:
    """The commit's model and optimizer with each part replaced by its shape and dtype; plain values kept."""
    def spec(v: Any) -> Any:
        return {"part": None, "of": v["of"], "shape": v["shape"], "dtype": v["part"].dtype} if _is_part(v) else v
    opt = commit["optimizer"]
    return {"model": {k: spec(v) for k, v in commit["model"].items()},
            "optimizer": {"param_groups": opt["param_groups"],
                          "state": {k: {n: spec(v) for n, v in e.items()} for k, e in opt["state"].items()}}}


def _nbytes(spec: dict[str, Any]) -> int:
    n = 1
    for d in spec["shape"]:
        n *= int(d)
    return n * spec["dtype"].itemsize


def _rows(n: int, of: int, i: int) -> tuple[int, int]:
    """The rows ``[start, stop)`` of shard ``i`` of ``of`` of a tensor with ``n`` rows: FSDP2's layout (torch.chunk
    along dim 0: chunks of ceil(n / of) rows, the last ones shorter or empty)."""
    size = -(-n // of)
    start = min(n, i * size)
    return start, min(n, start + size)


def _shard_index(mesh: Any) -> dict[int, int]:
    """Rank -> the shard it holds on ``mesh`` (dims "replicate", "shard"): its column. Every replica group holds
    every shard, so ranks of different groups hold the same one."""
    return {int(r): j for row in mesh.mesh.tolist() for j, r in enumerate(row)}


class _Move:
    """The rows of a commit's parts, moved point to point from the old layout to the new one.

    Every rank computes the same plan from the same facts: which old shard each rank holds
    (``held``: None for a joiner), the lowest rank holding each old shard (``source``) and which
    new shard each rank will hold (``shard_of``, of ``size``). A rank copies the rows it already
    holds and receives the others from their source, which sends them to every rank that needs them;
    one tensor at a time, each with its own tag.
    """

    def __init__(self, held: list[int | None], source: dict[int, int], shard_of: dict[int, int], size: int,
                 rank: int) -> None:
        self.held, self.source, self.shard_of, self.size, self.rank = held, source, shard_of, size, rank
        self.comm = Comm()  # the new group's default process group; its stats count the bytes received
        self.tag = 0

    def rows(self, spec: dict[str, Any], part: dict[str, Any] | None) -> torch.Tensor:
        """This rank's rows of the new layout of the tensor ``spec`` outlines; ``part``: its part of the commit."""
        shape, of = list(spec["shape"]), int(spec["of"])
        n, rest = shape[0], shape[1:]
        lo, hi = _rows(n, self.size, self.shard_of[self.rank])
        out = torch.empty([hi - lo, *rest], dtype=spec["dtype"])
        mine = self.held[self.rank]
        sends: list[tuple[int, torch.Tensor]] = []
        recvs: list[tuple[int, torch.Tensor]] = []
        for i in range(of):  # what this rank needs, from each old shard
            a, b = _rows(n, of, i)
            x, y = max(a, lo), min(b, hi)
            if x >= y:
                continue
            if i == mine:
                out[x - lo:y - lo] = part["part"][x - a:y - a]  # held already: copied, not sent
            else:
                recvs.append((self.source[i], out[x - lo:y - lo]))
        if mine is not None and self.source[mine] == self.rank:  # what this rank's shard owes the others
            a, b = _rows(n, of, mine)
            for r, j in sorted(self.shard_of.items()):
                if r == self.rank or self.held[r] == mine:
                    continue
                start, stop = _rows(n, self.size, j)
                x, y = max(a, start), min(b, stop)
                if x < y:
                    sends.append((r, part["part"][x - a:y - a]))
        self.comm.send_recv_([s for s in sends if s[1].numel()], [r for r in recvs if r[1].numel()], tag=self.tag)
        self.tag += 1
        return out


def _dtensor_like(local: torch.Tensor, spec: dict[str, Any], param: torch.Tensor) -> torch.Tensor:
    """``local`` (this rank's rows of the tensor ``spec`` outlines) as a DTensor laid out as ``param``."""
    from torch.distributed.tensor import DTensor  # loaded: param is one
    shape = torch.Size(spec["shape"])
    stride = torch.empty(shape, device="meta").stride()
    return DTensor.from_local(local.to(param.device), param.device_mesh, param.placements, shape=shape,
                              stride=stride)


def _to_meta(model: nn.Module) -> None:
    """Every parameter of ``model`` on the meta device (its whole shape and dtype, no storage); tied ones stay tied."""
    new: dict[int, tuple[torch.Tensor, nn.Parameter]] = {}  # id -> (old, new): the old kept alive, its id unique
    for m in model.modules():
        for leaf, p in m._parameters.items():
            if p is not None:
                if id(p) not in new:
                    new[id(p)] = (p, nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device="meta"),
                                                  requires_grad=p.requires_grad))
                m._parameters[leaf] = new[id(p)][1]


@torch.no_grad()
def _fill(model: nn.Module, rows: Callable[[str], torch.Tensor], device: torch.device) -> None:
    """Give each meta parameter of the freshly ``fully_shard``-ed ``model`` its local shard ``rows(name)``.

    torch's deferred initialisation (``fully_shard`` on the meta device, then storage) expects
    ``to_empty`` or ``load_state_dict(assign=True)``; here each parameter's contents are swapped
    for a DTensor of the same layout around the rows (``torch.utils.swap_tensors``: the same
    Parameter objects, so FSDP's references and tied weights hold), then each FSDP parameter
    re-reads its local tensor (``reset_sharded_param``, FSDP2's own step after ``to_empty``; private
    in torch 2.13, like :func:`_strip_fsdp`).
    """
    from torch.distributed.fsdp import FSDPModule, fully_shard
    from torch.distributed.tensor import DTensor  # loaded: fully_shard made the parameters DTensors

    for name, p in model.named_parameters():
        if p.device.type != "meta":
            continue  # a plain value put whole (not a part of the commit): fully_shard sharded it itself
        local = DTensor.from_local(rows(name).to(device), p.device_mesh, p.placements, shape=p.shape,
                                   stride=p.stride())
        torch.utils.swap_tensors(p, nn.Parameter(local, requires_grad=p.requires_grad))
    for m in model.modules():
        if isinstance(m, FSDPModule):
            for pg in fully_shard.state(m)._fsdp_param_groups:
                for fsdp_param in pg.fsdp_params:
                    fsdp_param.reset_sharded_param()


def _put(model: nn.Module, name: str, value: torch.Tensor) -> None:
    """Set the parameter or buffer ``name`` of ``model`` to ``value`` (a plain tensor), keeping requires_grad."""
    owner_name, _, leaf = name.rpartition(".")
    owner = model.get_submodule(owner_name)
    if leaf in owner._parameters:
        old = owner._parameters[leaf]
        owner._parameters[leaf] = nn.Parameter(value, requires_grad=old.requires_grad if old is not None else True)
    else:
        owner._buffers[leaf] = value


def _strip_fsdp(model: nn.Module) -> None:
    """Undo ``fully_shard`` on ``model`` in place: its hooks, its state and its class go; the parameters stay
    as they are (DTensors of a dead mesh) until replaced.

    torch has no public inverse of ``fully_shard``; this is the one place that reaches into FSDP2's
    private parts (torch 2.13): the forward hooks and state-dict hooks its state and parameters registered, the
    composable-API registry entry that refuses a second ``fully_shard``, and the class swap.
    """
    from torch.distributed._composable.contract import REGISTRY_KEY, STATE_KEY
    from torch.distributed._composable_state import _module_state_mapping
    from torch.distributed.fsdp import FSDPModule, fully_shard

    for m in model.modules():
        if isinstance(m, FSDPModule):
            state = fully_shard.state(m)
            if state is not None:
                for handle in (state._pre_forward_hook_handle, state._post_forward_hook_handle):
                    handle.remove()
                for pg in state._fsdp_param_groups:
                    for fsdp_param in pg.fsdp_params:  # each parameter's load_state_dict post-hook
                        fsdp_param._post_load_hook_handle.remove()
                    for handles in (pg._module_to_pre_save_state_dict_hook_handle,
                                    pg._module_to_pre_load_state_dict_hook_handle):
                        for h in handles.values():
                            h.remove()
                        handles.clear()
            _module_state_mapping.pop(m, None)
            states = m.__dict__.get(STATE_KEY, {})
            for k in [k for k in states if getattr(k, "__name__", "") == "fully_shard"]:
                del states[k]
            m.__dict__.get(REGISTRY_KEY, {}).pop("fully_shard", None)
            m.__class__ = type(m).__mro__[FSDPModule._orig_cls_mro_index]
        for attr in ("_is_fsdp_managed_module", "_fsdp_use_orig_params"):
            m.__dict__.pop(attr, None)


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


__all__ = ["FullyShard", "ShardLostError", "is_sharded", "local_parts", "sharded_by"]
