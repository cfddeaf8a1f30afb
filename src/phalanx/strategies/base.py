"""The strategy template: how replicas agree.

phalanx follows the five-part template of the Platoon design:

1. sampler: :func:`phalanx.shard`;
2. local dynamics: the user's own ``torch.optim`` optimizer;
3. sync condition: a :class:`SyncCondition` such as ``px.every(k)``;
4. exchange rule: an :class:`Exchange`, or a whole :class:`Strategy`;
5. finish condition: the user's loop, or ``Trainer.fit(epochs=...)``.

A :class:`Strategy` sees training through three hooks, all optional: ``attach`` once,
then per step ``after_backward(step)`` (inside ``backward()``, once the step's gradient
is complete: average gradients here) and ``after_step(step, taken)`` (after
``optimizer.step()``, or when this rank skipped it: exchange parameters here). The
framework owns the step count (:mod:`phalanx.step.clock`) and passes it in; it is the same
on every rank. Mutable state goes in ``state_dict`` (shared by every rank) or
``replica_state_dict`` (this rank's own), so checkpoints hold it.

Example (a complete custom rule: average parameters every 4 steps):
    >>> import torch, phalanx as px
    >>> class Average(px.Exchange):
    ...     def exchange(self, params, comm, step):
    ...         comm.all_reduce_([p.data for p in params])
    >>> strategy = px.Periodic(px.every(4), Average())
"""
from __future__ import annotations

import itertools
import zlib
from typing import Any, Callable, Protocol, runtime_checkable

import torch
from torch import nn

from ..group.collectives import Comm, local_shard
from ..group.env import WorkerEnv
from ..errors import ConfigError, usage
from ..step.clock import StepClock
from .accounting import Accounting
from .buffers import BufferMean


def from_rank_0(comm: Comm, model: nn.Module) -> None:
    """How ``px.wrap`` starts the replicas: every rank takes rank 0's parameters and buffers (one broadcast)."""
    comm.broadcast_([t.data for t in model.state_dict(keep_vars=True).values()])


def parameters_as_they_are(comm: Comm, model: nn.Module) -> None:
    """How a rule that takes over at a commit point starts (``px.Auto``): the parameters are one model already, and
    sending them again cost a whole model's bytes (2.2 s of a GPT's on 10 Mbit/s); only the buffers, which no rule
    keeps equal (BatchNorm's statistics), take rank 0's."""
    params = {id(p) for p in model.parameters()}
    comm.broadcast_([t.data for t in model.state_dict(keep_vars=True).values() if id(t) not in params])


#: How :meth:`Strategy.attach` makes the replicas one model: :func:`from_rank_0` or :func:`parameters_as_they_are`.
Start = Callable[[Comm, nn.Module], None]


@runtime_checkable
class SyncCondition(Protocol):
    """When replicas talk: called with the 1-based framework step count."""

    def __call__(self, step: int) -> bool: ...


class Exchange:
    """How replicas reconcile at a sync point. Override :meth:`exchange`."""

    def setup(self, params: list[nn.Parameter], comm: Comm) -> None:
        """Called once after the initial broadcast; allocate state here."""

    def exchange(self, params: list[nn.Parameter], comm: Comm, step: int) -> None:
        """Reconcile ``params`` with the other replicas at (1-based) ``step``; collective."""
        raise NotImplementedError

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


def check_same_model(model: nn.Module, comm: Comm, device: torch.device | None = None) -> None:
    """Refuse, on every rank, a model whose tensor names, shapes or dtypes differ between ranks.

    Collective: one 8-byte all-gather of a checksum, on ``device`` (default: the model's; a model on the
    meta device names the workers' device); the full lists travel only on a mismatch.
    """
    if comm.world_size == 1:
        return
    layout = [(name, tuple(t.shape), str(t.dtype)) for name, t in model.state_dict(keep_vars=True).items()]
    digest = torch.tensor([zlib.crc32(repr(layout).encode())], dtype=torch.int64, device=device or device_of(model))
    if len({int(d) for d in comm.all_gather(digest)}) == 1:
        return
    other, theirs = next((r, lay) for r, lay in enumerate(comm.all_gather_state(layout)) if lay != layout)
    mine_first, theirs_first = next((a, b) for a, b in itertools.zip_longest(layout, theirs) if a != b)
    raise ConfigError(usage(
        f"a model that differs between ranks: rank {comm.rank} has {_entry(mine_first)} where rank {other} has "
        f"{_entry(theirs_first)}", "the same architecture on every rank (px.wrap then copies rank 0's weights "
        "to all)", "Build the model identically everywhere; only the seed may differ."))


def _entry(entry: tuple[str, tuple[int, ...], str] | None) -> str:
    return "nothing" if entry is None else f"{entry[0]!r} of shape {entry[1]} ({entry[2]})"


def device_of(model: nn.Module) -> torch.device:
    """The device of ``model``'s first parameter (else its first buffer; a model with neither: the CPU).

    The one device-of helper: strategies and checkpoints ask it where a model's tensors live.

    Example:
        >>> device_of(torch.nn.Linear(2, 1))
        device(type='cpu')
    """
    for tensor in (*model.parameters(), *model.buffers()):
        return tensor.device
    return torch.device("cpu")


class Strategy:
    """A rule for how replicas agree: attach, two per-step hooks, finish, its state, and the step count.

    These seven members are the whole protocol every rule implements (each has a default here). A rule
    that takes part in a feature implements that feature's small Protocol as well, and the feature checks
    it with ``isinstance``; where a rule does not, the feature does nothing for it:

    * ``step.protocols.WeighsGradients``: ``weighs_gradients(step)``, the batch weight scales gradients;
    * ``step.protocols.ReplicasAgree``: ``replicas_agree(step)``, where a commit or a stop may be taken;
    * ``checkpoint.training_state.ReplicaState``: ``replica_state_dict`` / ``load_replica_state_dict``;
    * :class:`Joinable`: ``load_joiner_state_dict``, a worker entering a running elastic job;
    * :class:`ServerBacked`: ``launched_with(env)``, agrees through parameter servers;
    * ``strategies.accounting.Accounted``: ``bytes_sent``, ``bytes_per_step``;
    * ``data.balance.UnevenBatches``: ``uneven_batches``, workers may hold parts of different sizes;
    * ``sharding.layout.OnShards``: ``on_shards()``, exchanges each rank's shard;
    * ``elastic.rule.Regroupable``: ``regroup()``, after the group was rebuilt;
    * ``elastic.rule.CommitPoint``: ``commit_point()``, around an elastic commit.

    The base class broadcasts rank 0's parameters and buffers on attach, so replicas start identical
    even when the workers' seeds differ. ``state_dict()`` is the rule's own pure read; whoever captures
    state adds the framework's step (:func:`state_with_step`) after closing a skipped step explicitly
    (``strategy.clock.settle()``).
    """

    def __init__(self) -> None:
        self.comm = Comm()
        self.clock = StepClock()

    def attach(self, model: nn.Module, optimizer: torch.optim.Optimizer, *, start: Start = from_rank_0) -> nn.Module:
        """Called once by ``px.wrap``; returns the module the user trains. ``start``: how the replicas become one
        model (rank 0's, unless a rule takes over from replicas that are one already)."""
        self.model, self.optimizer = model, optimizer
        # A sharded model's parameters (phalanx.sharding) are seen as this rank's shards: the rule exchanges those.
        self.params = [local_shard(p) for p in model.parameters() if p.requires_grad]
        check_same_model(model, self.comm)  # before the broadcast, which would fail obscurely otherwise
        start(self.comm, model)
        self._attach_mark = (self.comm.stats.bytes_sent, self.steps)  # for bytes_per_step (strategies.accounting)
        return model

    def after_backward(self, step: int) -> None:
        """Inside ``backward()``, once step ``step``'s gradient is complete: average gradients here."""

    def after_step(self, step: int, taken: bool) -> None:
        """After step ``step`` on every rank: ``taken`` is False where ``optimizer.step()`` was skipped."""

    @property
    def steps(self) -> int:
        """Training steps so far (the framework's count, identical on every rank)."""
        return self.clock.step

    def state_dict(self) -> dict[str, Any]:
        """Shared state, identical on every rank (tensors and plain values only). A pure read: no collective."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned (rank 0's, on every rank)."""

    def finish(self) -> None:
        """Collective, once when training ends: close a skipped last step (its exchange runs on every rank).

        A rule whose replicas drift apart between syncs overrides this: ``super().finish()`` first, then
        leave every replica holding the model to keep (a last average, or EASGD's centre).
        """
        self.clock.settle()

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


@runtime_checkable
class Joinable(Protocol):
    """A rule whose worker entering a running elastic job takes rank 0's shared state otherwise than a rollback.

    :func:`load_state_with_step` calls it for a joiner (``phalanx.ps``: the servers are not put back); a rule
    without it gives a joiner its ``load_state_dict``, as a rollback does.
    """

    def load_joiner_state_dict(self, state: dict[str, Any]) -> None: ...


@runtime_checkable
class ServerBacked(Protocol):
    """A rule whose replicas agree through parameter servers (``phalanx.ps``'s rules), which hold the model.

    ``px.wrap`` hands it what ``phalanx run`` set up (the servers of ``--servers N``); beside any other rule
    those servers would idle, and ``px.wrap`` warns. ``shard=`` refuses it.
    """

    def launched_with(self, env: WorkerEnv) -> None: ...


def state_with_step(strategy: Strategy) -> dict[str, Any]:
    """``strategy.state_dict()`` plus the framework's ``"step"``: what checkpoints and commits hold. A pure read.

    Example:
        >>> import torch, phalanx as px
        >>> from phalanx.strategies.base import state_with_step
        >>> net = torch.nn.Linear(2, 1)
        >>> model, opt = px.wrap(net, torch.optim.SGD(net.parameters(), lr=0.1))
        >>> state_with_step(px.strategy_of(opt))
        {'step': 0}
    """
    return {**strategy.state_dict(), "step": strategy.clock.step}


def load_state_with_step(strategy: Strategy, state: dict[str, Any], *, joining: bool = False) -> None:
    """Restore what :func:`state_with_step` returned: the rule's state, then the step count.

    ``joining``: this worker enters a running elastic job; a :class:`Joinable` rule takes rank 0's state
    through ``load_joiner_state_dict``, any other through ``load_state_dict``.

    Example:
        >>> import torch, phalanx as px
        >>> net = torch.nn.Linear(2, 1)
        >>> model, opt = px.wrap(net, torch.optim.SGD(net.parameters(), lr=0.1))
        >>> load_state_with_step(px.strategy_of(opt), {"step": 7}); px.strategy_of(opt).steps
        7
    """
    (strategy.load_joiner_state_dict if joining and isinstance(strategy, Joinable) else strategy.load_state_dict)(
        state)
    step = state["step"] if "step" in state else state.get("steps", 0)  # "steps": files from older versions
    strategy.clock.restore(step)


class StepState:
    """The step count folded into a rule's state, as methods (mixed into every built-in rule).

    The same as :func:`state_with_step`, :func:`load_state_with_step` and ``clock.settle()`` (what the
    framework calls, for any rule), for scripts that call them on ``px.strategy_of(opt)``.
    """

    def settle(self: Strategy) -> None:
        """Close a step this rank skipped (its ``optimizer.step()`` never ran): collective, explicit.

        ``after_step(step, taken=False)`` runs now rather than at the next forward pass, so every rank has
        run the same exchanges; a no-op when nothing is pending.
        """
        self.clock.settle()

    def state_with_step(self: Strategy) -> dict[str, Any]:
        """:func:`state_with_step` of this rule."""
        return state_with_step(self)

    def load_state_with_step(self: Strategy, state: dict[str, Any], *, joining: bool = False) -> None:
        """:func:`load_state_with_step` for this rule."""
        load_state_with_step(self, state, joining=joining)


def compressor_replica_state(strategy: Any) -> dict[str, Any]:
    """A rule's compressor's own part (its residuals), for its ``replica_state_dict``; {} without a compressor.

    The shared part (PowerSGD's Q) is in the rule's ``state_dict``.

    Example:
        >>> import phalanx as px
        >>> compressor_replica_state(px.AllReduce()), compressor_replica_state(px.AllReduce(compression=px.TopK(0.1)))
        ({}, {'compression': {'residuals': {}}})
    """
    compression = getattr(strategy, "compression", None)
    return {"compression": compression.replica_state_dict()} if compression is not None else {}


def load_compressor_replica_state(strategy: Any, state: dict[str, Any]) -> None:
    """Put back what :func:`compressor_replica_state` captured."""
    if "compression" in state:
        strategy.compression.load_replica_state_dict(state["compression"])


class Periodic(Accounting, StepState, Strategy):
    """Local steps, then an exchange whenever the sync condition says so.

    A step that this rank skipped (``taken=False``) still counts: the exchange runs on
    every rank at the same steps, with this rank's replica as the skipped step left it.
    Replicas drift apart between syncs: :meth:`finish` reconciles them (:meth:`reconcile`), and their
    weights and optimizer states are each worker's replica state.

    Example:
        >>> import phalanx as px
        >>> px.Periodic(px.every(8), px.ParameterAverage())
        Periodic(every(8), ParameterAverage)
    """

    def __init__(self, sync: SyncCondition, exchange: Exchange) -> None:
        super().__init__()
        self.sync, self.exchange = sync, exchange

    def attach(self, model: nn.Module, optimizer: torch.optim.Optimizer, *, start: Start = from_rank_0) -> nn.Module:
        module = super().attach(model, optimizer, start=start)
        self.exchange.setup(self.params, self.comm)
        self.running_stats = BufferMean(model.buffers())  # BatchNorm's statistics drift with the replicas
        return module

    def after_step(self, step: int, taken: bool) -> None:
        if self.sync(step):
            self.exchange.exchange(self.params, self.comm, step)
            self.running_stats.average_(self.comm)

    def on_shards(self) -> bool:
        return True  # the exchange sees parameters only; a shard is exchanged with the same shard elsewhere

    def state_dict(self) -> dict[str, Any]:
        return {"exchange": self.exchange.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.exchange.load_state_dict(state["exchange"])

    def row_state(self) -> dict[str, list[torch.Tensor]]:
        """The exchange's per-parameter tensors (``phalanx.sharding.reshard.RowState``); {} where it keeps none."""
        rows = getattr(self.exchange, "row_state", None)
        return rows() if callable(rows) else {}

    def load_row_state(self, state: dict[str, list[torch.Tensor]]) -> None:
        """After a reshard: the exchange takes the new layout's rows."""
        if state:
            self.exchange.load_row_state(state)

    def replicas_agree(self, step: int) -> bool:
        return bool(self.sync(step))

    def finish(self) -> None:
        """Close a skipped last step, then :meth:`reconcile` (collective)."""
        super().finish()
        self.reconcile()

    def reconcile(self) -> None:
        """Exchange once more if local steps were taken since the last sync."""
        if self.steps and not self.sync(self.steps):
            self.exchange.exchange(self.params, self.comm, self.steps)
            self.running_stats.average_(self.comm)

    def replica_state_dict(self) -> dict[str, Any]:
        """Replicas differ between syncs, and so do their optimizers' states (momentum, Adam moments)."""
        return {**compressor_replica_state(self), **drifting_replica_state(self)}

    def load_replica_state_dict(self, state: dict[str, Any]) -> None:
        load_compressor_replica_state(self, state)
        load_drifting_replica_state(self, state)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.sync!r}, {type(self.exchange).__name__})"


class ParameterAverage(Exchange):
    """Replace every replica's parameters by their mean (model averaging)."""

    def exchange(self, params: list[nn.Parameter], comm: Comm, step: int) -> None:
        comm.all_reduce_([p.data for p in params])


def load_rows(mine: list[torch.Tensor], saved: list[torch.Tensor]) -> list[torch.Tensor]:
    """``saved`` into ``mine`` in place where the shapes agree; a tensor laid out for other rows (a commit of
    another layout, which a reshard then replaces) is taken as it is.

    Example:
        >>> [t.tolist() for t in load_rows([torch.zeros(2), torch.zeros(1)], [torch.ones(2), torch.ones(3)])]
        [[1.0, 1.0], [1.0, 1.0, 1.0]]
    """
    out = []
    for m, v in zip(mine, saved, strict=True):
        if m.shape == v.shape:
            out.append(m.copy_(v))
        else:
            out.append(v.detach().to(m.device, m.dtype, copy=True))
    return out


def drifting_replica_state(strategy: Strategy) -> dict[str, Any]:
    """A replica's own weights and optimizer state, for rules whose replicas drift apart between syncs."""
    return {"params": [p.detach().clone() for p in strategy.params], "optimizer": strategy.optimizer.state_dict()}


def load_drifting_replica_state(strategy: Strategy, state: dict[str, Any]) -> None:
    """Put back what :func:`drifting_replica_state` captured."""
    with torch.no_grad():
        for p, saved in zip(strategy.params, state["params"], strict=True):
            p.copy_(saved)
    strategy.optimizer.load_state_dict(state["optimizer"])
