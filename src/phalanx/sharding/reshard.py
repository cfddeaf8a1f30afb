"""Resharding at a regroup: a commit's shards moved from the old layout onto the new one.

:mod:`phalanx.sharding.layout` lays a model out with FSDP2; this module moves what an elastic
commit holds (each worker's shards of the model and optimizer, as :func:`local_parts`)
onto the layout of a rebuilt group. Every worker computes the same plan: which old shard
each worker holds (a joiner none), the lowest surviving holder of each, and each worker's
new shard on the new mesh (rows follow FSDP2's dim-0 ``torch.chunk`` layout). Each worker
then receives, point to point, only the rows of its new shard that it lacks; no worker
ever holds a whole tensor. :func:`reshard_empty` lays the new shards out with undefined
values instead, for a DCP checkpoint to fill (the fallback when a shard died with its
only holder: :class:`ShardLostError`).

Example:
    >>> from phalanx.sharding.reshard import _rows
    >>> [_rows(10, 3, i) for i in range(3)]      # FSDP2's layout of 10 rows over 3 shards
    [(0, 4), (4, 8), (8, 10)]
"""
from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any, Callable, Protocol, runtime_checkable

import torch
from torch import nn

from ..group.collectives import Comm, all_gather_object, broadcast_object
from ..errors import ConfigError, PhalanxError, usage
from .layout import FullyShard
from ..strategies import Strategy

if TYPE_CHECKING:
    from ..group.group import Group


@runtime_checkable
class RowState(Protocol):
    """What a rule on shards keeps per parameter, laid out as the parameters' local rows, moved by a reshard.

    A periodic rule on shards (DiLoCo's anchor and outer momentum, EASGD's centre) holds, for each of its
    parameters (``strategy.params``: this rank's rows of each), tensors of the same rows. A regroup moves
    them with the parameters' own plan (:func:`reshard`): each rank receives only the rows it lacks.
    A rule that keeps none returns ``{}``.

    Example:
        >>> import phalanx as px
        >>> isinstance(px.DiLoCo(every=4), RowState), isinstance(px.AllReduce(), RowState)
        (True, False)
    """

    def row_state(self) -> dict[str, list[torch.Tensor]]:
        """The live tensors, by name, one per parameter in ``strategy.params``'s order (a pure read)."""
        ...

    def load_row_state(self, state: dict[str, list[torch.Tensor]]) -> None:
        """Take ``state`` (the new layout's rows, as :meth:`row_state` names them) in place of the old."""
        ...


def reshard(layout: FullyShard, model: nn.Module, optimizer: torch.optim.Optimizer, strategy: Strategy, g: "Group",
            commit: dict[str, Any] | None) -> dict[str, int]:
    """After ``g`` was rebuilt: shard ``model`` over the new group from the commit the survivors hold.

    Collective over the new group. ``commit`` is this worker's (its ``model`` and ``optimizer``
    as :func:`local_parts`), or None for a worker that holds none (a joiner, a spare). Each
    worker receives, point to point, only the rows of its new shard that it does not hold
    already, each from the lowest rank that holds them (any surviving replica group holds every
    shard), and builds its new shard from them: no worker ever holds a whole tensor of the model
    or of the optimizer state (plain values, such as buffers, come whole from one holder). The
    new layout keeps ``group_size`` where it divides the new world size, and is one group of
    every worker (FSDP) otherwise. The rule's own rows (:class:`RowState`: the commit's ``rows``) move by
    the same plan. A part that only lost workers held (R = 1) raises
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
    size = _size_on(layout, g)
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
    trainable = [name for name, p in model.named_parameters() if p.requires_grad]  # strategy.params's order
    mine_rule = (commit.get("rows") or {}) if held else {}
    rule_specs = {key: [{**outline["model"][name], "dtype": dtype} for name, dtype in zip(trainable, dtypes,
                                                                                           strict=True)]
                  for key, dtypes in outline["rows"].items()}
    rule_rows = {key: [move.rows(spec, {"part": mine_rule[key][i]} if held else None) for i, spec in enumerate(specs)]
                 for key, specs in rule_specs.items()}
    _shard_anew(layout, model, optimizer, strategy, g, size, rows.__getitem__, plain)
    if rule_rows and isinstance(strategy, RowState):
        strategy.load_row_state({key: [t.to(g.device) for t in ts] for key, ts in rule_rows.items()})
    params = [p for pg in optimizer.param_groups for p in pg["params"]]
    state = {key: {name: _dtensor_like(opt_rows[key, name], spec, params[int(key)]) if _is_part(spec) else spec
                   for name, spec in entries.items()} for key, entries in theirs.items()}
    optimizer.load_state_dict({"state": state, "param_groups": outline["optimizer"]["param_groups"]})
    parts = [*(v for k, v in outline["model"].items() if k in unique),
             *(v for e in theirs.values() for v in e.values()), *(v for specs in rule_specs.values() for v in specs)]
    return {"received_bytes": move.comm.stats.bytes_received,
            "state_bytes": sum(_nbytes(v) for v in parts if _is_part(v))}


def reshard_empty(layout: FullyShard, model: nn.Module, optimizer: torch.optim.Optimizer, strategy: Strategy,
                  g: "Group") -> None:
    """Shard ``model`` over the new group with undefined values, for ``px.load_checkpoint`` to fill (DCP
    reshards a checkpoint onto the new layout): the fallback when :func:`reshard` found a shard lost.
    Collective. Each worker allocates its new shards only."""
    size = _size_on(layout, g)
    index = _shard_index(g.mesh(size))[g.rank]
    shapes = {name: (list(p.shape), p.dtype) for name, p in model.named_parameters()}  # global shapes

    def room(name: str) -> torch.Tensor:
        shape, dtype = shapes[name]
        lo, hi = _rows(shape[0], size, index)
        return torch.empty([hi - lo, *shape[1:]], dtype=dtype)

    _shard_anew(layout, model, optimizer, strategy, g, size, room, {})


def _size_on(layout: FullyShard, g: "Group") -> int:
    """S of the layout after a regroup: ``group_size`` where it divides the world size, else every worker."""
    return layout.group_size if g.world_size % layout.group_size == 0 else g.world_size


def _shard_anew(layout: FullyShard, model: nn.Module, optimizer: torch.optim.Optimizer, strategy: Strategy,
                g: "Group", size: int, rows: Callable[[str], torch.Tensor], plain: dict[str, Any]) -> None:
    """Take FSDP off ``model`` and shard it over ``g`` anew, in shards of ``size``.

    Collective. The parameters go to the meta device (shape and dtype, no storage: :func:`let_go`), ``plain``
    values (buffers) are put whole, ``fully_shard`` lays the meta parameters out on the new
    mesh, and each parameter ``name`` then takes ``rows(name)``, its local shard on this rank.
    """
    let_go(model, optimizer, strategy)
    names = {id(p): name for name, p in model.named_parameters()}
    for name, value in plain.items():
        _put(model, name, value)
    meta = dict(model.named_parameters())
    for pg in optimizer.param_groups:
        pg["params"] = [meta[names[id(p)]] for p in pg["params"]]
    layout.shard_over(model, optimizer, strategy, g, size, fill=lambda m: _fill(m, rows, g.device))
    layout.rehook(model, g, size)


def let_go(model: nn.Module, optimizer: torch.optim.Optimizer, strategy: Strategy) -> None:
    """Drop every reference the sharded ``model``, ``optimizer`` and ``strategy`` hold to the generation's process
    groups: FSDP comes off the model, the parameters go to the meta device (shape and dtype, no storage), the
    optimizer's state goes, the rule's comm goes back to the default group, and DTensor's caches are cleared.
    Local; idempotent. Afterwards the live model holds nothing: a regroup lays it out anew from the commit
    (:func:`reshard`) or from the checkpoint (:func:`reshard_empty`).

    Why: gloo closes a group's sockets only when the group object is freed, and FSDP's modules, the parameters'
    and the Adam moments' meshes and the sharding caches all hold this generation's subgroups. A worker that
    leaves the generation while they live keeps its sockets open, and a peer of another replica group blocked in
    an all-reduce with it (HSDP: rank 2 with rank 0 when rank 1 dies) waits its whole collective timeout
    instead of failing at once, and misses the quorum. Call it before the generation's groups are destroyed.

    Example (a plain model holds no mesh: nothing to let go of but the optimizer's state):
        >>> import torch, phalanx as px
        >>> net = torch.nn.Linear(2, 1); opt = torch.optim.SGD(net.parameters(), lr=0.1)
        >>> let_go(net, opt, px.AllReduce()); net.weight.is_meta
        True
    """
    names = {id(p): name for name, p in model.named_parameters()}
    _strip_fsdp(model)
    _to_meta(model)
    meta = dict(model.named_parameters())
    for pg in optimizer.param_groups:
        pg["params"] = [meta[names[id(p)]] if id(p) in names else p for p in pg["params"]]
    optimizer.state.clear()
    if getattr(strategy, "comm", None) is not None and strategy.comm.group is not None:
        strategy.comm = Comm()  # its replicate group is the generation's; shard_over gives it the next one's
    _forget_meshes()


def _forget_meshes() -> None:
    """Empty DTensor's caches keyed by mesh (private in torch 2.13, like :func:`_strip_fsdp`).

    Two reasons. Meshes of two generations with the same shape compare equal: without this, the new parameters
    would come back on an earlier generation's mesh, with that generation's coordinates (seen on torch 2.13: 2x2
    -> 1x3 -> 2x2 gave rank 1 the shard of rank 2). And each cache holds the old meshes, and through them their
    process groups, whose sockets then stay open (seen on torch 2.13: the redistribution plans and the mesh
    topology cache kept the 2x2 mesh of a dead generation alive after everything else had let go).
    """
    from torch.distributed.tensor import _collective_utils, _redistribute
    from torch.distributed.tensor.debug import _clear_sharding_prop_cache

    _clear_sharding_prop_cache()
    _redistribute._gen_transform_infos.cache_clear()
    _redistribute.clear_redistribute_planner_cache()
    _collective_utils.MeshTopoInfo.build_from_mesh.cache_clear()


class ShardLostError(PhalanxError):
    """A regroup found a shard of the in-memory commit that only lost workers held (one replica group)."""

    def __init__(self, text: str, lost: str = "a shard") -> None:
        super().__init__(text)
        self.lost = lost  # e.g. "shard 1 of 2"


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
                          "state": {k: {n: spec(v) for n, v in e.items()} for k, e in opt["state"].items()}},
            "rows": {key: [t.dtype for t in ts] for key, ts in (commit.get("rows") or {}).items()}}


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


__all__ = ["RowState", "ShardLostError", "let_go", "local_parts", "reshard", "reshard_empty"]
