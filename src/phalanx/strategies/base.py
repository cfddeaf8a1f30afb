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
import warnings
import zlib
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn

from ..group.collectives import Comm, local_shard
from ..errors import ConfigError, usage
from ..step.clock import StepClock
from ..group.env import WorkerEnv
from .buffers import BufferMean


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


def check_same_model(model: nn.Module, comm: Comm) -> None:
    """Refuse, on every rank, a model whose tensor names, shapes or dtypes differ between ranks.

    Collective: one 8-byte all-gather of a checksum; the full lists travel only on a mismatch.
    """
    if comm.world_size == 1:
        return
    layout = [(name, tuple(t.shape), str(t.dtype)) for name, t in model.state_dict(keep_vars=True).items()]
    digest = torch.tensor([zlib.crc32(repr(layout).encode())], dtype=torch.int64, device=_device_of(model))
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


def _device_of(model: nn.Module) -> torch.device:
    first = next(iter(model.state_dict().values()), None)
    return first.device if first is not None else torch.device("cpu")


class Strategy:
    """Base of every strategy: attach, then the two per-step hooks; every other hook has a no-op default.

    The base class broadcasts rank 0's parameters and buffers on attach, so replicas
    start identical even when the workers' seeds differ. Nothing here rewrites a
    subclass's methods: ``state_dict()`` is the subclass's own pure read, and whoever
    captures state adds the framework's step (:meth:`state_with_step`) after closing
    a skipped step explicitly (:meth:`settle`).
    """

    #: Name used by ``px.wrap(..., strategy="name")`` and the benchmark.
    name = "custom"
    #: True for strategies that talk to parameter servers (``phalanx run --servers N``).
    uses_servers = False
    #: True when the rule weights each worker by its share of the global batch, so workers may hold parts of
    #: different sizes (``px.shard(..., balance="speed")``); a rule that counts every worker alike keeps False.
    uneven_batches = False
    #: The ``px.FullyShard`` that ``px.wrap(..., shard=...)`` applied (phalanx.sharding.layout), or None.
    sharded_by: Any = None

    def __init__(self) -> None:
        self.comm = Comm()
        self.clock = StepClock()

    # -- the template ---------------------------------------------------------
    def attach(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> nn.Module:
        """Called once by ``px.wrap``; returns the module the user trains."""
        self.model, self.optimizer = model, optimizer
        # A sharded model's parameters (phalanx.sharding) are seen as this rank's shards: the rule exchanges those.
        self.params = [local_shard(p) for p in model.parameters() if p.requires_grad]
        check_same_model(model, self.comm)  # before the broadcast, which would fail obscurely otherwise
        self.comm.broadcast_([t.data for t in model.state_dict(keep_vars=True).values()])
        self._attach_mark = (self.comm.stats.bytes_sent, self.steps)  # for bytes_per_step
        return model

    def after_backward(self, step: int) -> None:
        """Inside ``backward()``, once step ``step``'s gradient is complete: average gradients here."""

    def on_shards(self) -> bool:
        """True where this rule works on each rank's shard of the parameters (``px.wrap(..., shard=...)``):
        it then exchanges them, never their gradients, over the mesh's "replicate" group."""
        return False

    def after_step(self, step: int, taken: bool) -> None:
        """After step ``step`` on every rank: ``taken`` is False where ``optimizer.step()`` was skipped."""

    def weighs_gradients(self, step: int) -> bool:
        """True where step ``step``'s gradients are averaged over the workers (``phalanx.step.clock`` then weights
        each backward pass by this worker's share of the batch); local steps keep their own mean gradient."""
        return False

    @property
    def steps(self) -> int:
        """Training steps so far (the framework's count, identical on every rank)."""
        return self.clock.step

    def settle(self) -> None:
        """Close a step this rank skipped (its ``optimizer.step()`` never ran): collective, explicit.

        ``after_step(step, taken=False)`` runs now rather than at the next forward pass, so
        every rank has run the same exchanges. Whoever captures state or ends training calls
        it first (:func:`phalanx.save_checkpoint`, :meth:`finish`); a no-op when nothing is pending.
        """
        self.clock.settle()

    # -- state ------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Shared state, identical on every rank (tensors and plain values only). A pure read: no collective."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned (rank 0's, on every rank)."""

    def state_with_step(self) -> dict[str, Any]:
        """:meth:`state_dict` plus the framework's ``"step"``: what checkpoints and commits hold. A pure read.

        Example:
            >>> import torch, phalanx as px
            >>> net = torch.nn.Linear(2, 1)
            >>> model, opt = px.wrap(net, torch.optim.SGD(net.parameters(), lr=0.1))
            >>> px.strategy_of(opt).state_with_step()
            {'step': 0}
        """
        return {**self.state_dict(), "step": self.clock.step}

    def load_state_with_step(self, state: dict[str, Any], *, joining: bool = False) -> None:
        """Restore what :meth:`state_with_step` returned: the subclass's state, then the step count.

        ``joining``: this worker enters a running elastic job and takes rank 0's state through
        :meth:`load_joiner_state_dict` instead of :meth:`load_state_dict`.
        """
        (self.load_joiner_state_dict if joining else self.load_state_dict)(state)
        step = state["step"] if "step" in state else state.get("steps", 0)  # "steps": files from older versions
        self.clock.restore(step)

    def load_joiner_state_dict(self, state: dict[str, Any]) -> None:
        """A worker joining a running elastic job takes rank 0's shared state; by default as a rollback does."""
        self.load_state_dict(state)

    def replica_state_dict(self) -> dict[str, Any]:
        """This rank's own state that the other replicas do not share.

        By default: the compressor's own part (its residuals), when the strategy has a ``compression``;
        the shared part (PowerSGD's Q) is in the subclass's ``state_dict``.
        """
        compression = getattr(self, "compression", None)
        return {"compression": compression.replica_state_dict()} if compression is not None else {}

    def load_replica_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`replica_state_dict` returned on this rank."""
        if "compression" in state:
            self.compression.load_replica_state_dict(state["compression"])

    @property
    def bytes_sent(self) -> int:
        """Payload bytes this worker has sent so far."""
        return self.comm.stats.bytes_sent

    @property
    def bytes_per_step(self) -> float:
        """Mean payload bytes sent per step since attach (the initial broadcast excluded)."""
        bytes0, steps0 = getattr(self, "_attach_mark", (0, 0))
        return (self.comm.stats.bytes_sent - bytes0) / max(1, self.steps - steps0)

    # -- membership changes (phalanx.elastic); no-ops by default ----------------------------------------------
    def regroup(self) -> None:
        """Called by ``phalanx.elastic`` after the worker group was rebuilt with a new size.

        Strategies whose state depends on the world size (a divisor, a per-rank buffer) refresh it here.
        ``regroup`` has this one meaning, a rule's reaction; forming the new group is ``ElasticWorker.rebuild``.
        """

    def replicas_agree(self, step: int) -> bool:
        """True when, after ``step``, every replica holds the same model at the same step (a commit may be taken).

        Synchronous strategies agree after every step; periodic ones only at their sync points.
        """
        return True

    def commit_point(self) -> None:
        """Called on every rank just before and just after an elastic commit; collective where overridden.

        A strategy whose model lives outside the workers (asynchronous parameter servers) makes
        the commit one consistent cut here.
        """

    def launched_with(self, env: WorkerEnv) -> None:
        """Called once by ``px.wrap`` with what the launcher set up; warns about what this strategy ignores.

        By default: servers that ``phalanx run --servers N`` started, which only a parameter-server
        strategy uses.
        """
        if env.ps_servers and not self.uses_servers and env.rank == 0:
            warnings.warn(f"PHALANX_PS_ADDRS names {env.ps_servers} parameter servers (phalanx run --servers "
                          f"{env.ps_servers}) but strategy {type(self).__name__} uses none; drop --servers, or use "
                          "px.Downpour, px.AsyncEASGD or px.ParameterServer", stacklevel=4)

    # -- the end -------------------------------------------------------------------------------------------------
    def finish(self) -> None:
        """Collective, once when training ends: close a skipped last step, then :meth:`reconcile`.

        Override :meth:`reconcile`, not this: the last step's exchange must run on every rank first.
        """
        self.settle()
        self.reconcile()

    def reconcile(self) -> None:
        """Leave every replica holding the model to keep (called by :meth:`finish`).

        Strategies whose replicas drift apart between syncs reconcile here (a last
        average, or EASGD's centre variable); synchronous ones have nothing to do.
        """

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class Periodic(Strategy):
    """Local steps, then an exchange whenever the sync condition says so.

    A step that this rank skipped (``taken=False``) still counts: the exchange runs on
    every rank at the same steps, with this rank's replica as the skipped step left it.

    Example:
        >>> import phalanx as px
        >>> px.Periodic(px.every(8), px.ParameterAverage())
        Periodic(every(8), ParameterAverage)
    """

    name = "periodic"

    def __init__(self, sync: SyncCondition, exchange: Exchange) -> None:
        super().__init__()
        self.sync, self.exchange = sync, exchange

    def attach(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> nn.Module:
        module = super().attach(model, optimizer)
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

    def replicas_agree(self, step: int) -> bool:
        return bool(self.sync(step))

    def reconcile(self) -> None:
        """Exchange once more if local steps were taken since the last sync."""
        if self.steps and not self.sync(self.steps):
            self.exchange.exchange(self.params, self.comm, self.steps)
            self.running_stats.average_(self.comm)

    def replica_state_dict(self) -> dict[str, Any]:
        """Replicas differ between syncs, and so do their optimizers' states (momentum, Adam moments)."""
        return {**super().replica_state_dict(), **drifting_replica_state(self)}

    def load_replica_state_dict(self, state: dict[str, Any]) -> None:
        super().load_replica_state_dict(state)
        load_drifting_replica_state(self, state)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.sync!r}, {type(self.exchange).__name__})"


class ParameterAverage(Exchange):
    """Replace every replica's parameters by their mean (model averaging)."""

    def exchange(self, params: list[nn.Parameter], comm: Comm, step: int) -> None:
        comm.all_reduce_([p.data for p in params])


def drifting_replica_state(strategy: Strategy) -> dict[str, Any]:
    """A replica's own weights and optimizer state, for rules whose replicas drift apart between syncs."""
    return {"params": [p.detach().clone() for p in strategy.params], "optimizer": strategy.optimizer.state_dict()}


def load_drifting_replica_state(strategy: Strategy, state: dict[str, Any]) -> None:
    """Put back what :func:`drifting_replica_state` captured."""
    with torch.no_grad():
        for p, saved in zip(strategy.params, state["params"], strict=True):
            p.copy_(saved)
    strategy.optimizer.load_state_dict(state["optimizer"])
