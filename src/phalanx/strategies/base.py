"""The strategy template: how replicas agree.

phalanx follows the five-part template of the Platoon design:

1. sampler: :func:`phalanx.shard`;
2. local dynamics: the user's own ``torch.optim`` optimizer;
3. sync condition: a :class:`SyncCondition` such as ``px.every(k)``;
4. exchange rule: an :class:`Exchange`, or a whole :class:`Strategy`;
5. finish condition: the user's loop, or ``Trainer.fit(epochs=...)``.

A :class:`Strategy` sees the training step through three methods, all optional:
``attach`` once, then ``before_step`` and ``after_step`` around every
``optimizer.step()``. Mutable state goes in ``state_dict`` so checkpoints hold it.

Example (a complete custom rule: average parameters every 4 steps):
    >>> import torch, phalanx as px
    >>> class Average(px.Exchange):
    ...     def exchange(self, params, comm):
    ...         comm.all_reduce_([p.data for p in params])
    >>> strategy = px.Periodic(px.every(4), Average())
"""
from __future__ import annotations

import warnings
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn

from ..comm import Comm


@runtime_checkable
class SyncCondition(Protocol):
    """When replicas talk: called with the 1-based count of local steps taken."""

    def __call__(self, step: int) -> bool: ...


class Exchange:
    """How replicas reconcile at a sync point. Override :meth:`exchange`."""

    def setup(self, params: list[nn.Parameter], comm: Comm) -> None:
        """Called once after the initial broadcast; allocate state here."""

    def exchange(self, params: list[nn.Parameter], comm: Comm) -> None:
        raise NotImplementedError

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


class Strategy:
    """Base of every strategy: attach, then hook around ``optimizer.step()``.

    The base class broadcasts rank 0's parameters and buffers on attach, so
    replicas start identical even when the workers' seeds differ.
    """

    #: Name used by ``px.wrap(..., strategy="name")`` and the benchmark.
    name = "custom"

    def __init__(self) -> None:
        self.comm = Comm()
        self.steps = 0  # optimizer steps taken on this worker

    # -- the template ---------------------------------------------------------
    def attach(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> nn.Module:
        """Called once by ``px.wrap``; returns the module the user trains."""
        self.model, self.optimizer = model, optimizer
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.comm.broadcast_([t.data for t in model.state_dict(keep_vars=True).values()])
        self._attach_mark = (self.comm.stats.bytes_sent, self.steps)  # for bytes_per_step
        return model

    def before_step(self) -> None:
        """Runs before ``optimizer.step()``: exchange gradients here."""

    def after_step(self) -> None:
        """Runs after ``optimizer.step()``: exchange parameters here."""
        self.steps += 1

    # -- state ------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume exactly (tensors and plain values only)."""
        return {"steps": self.steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.steps = int(state["steps"])

    @property
    def bytes_sent(self) -> int:
        """Payload bytes this worker has sent so far."""
        return self.comm.stats.bytes_sent

    @property
    def bytes_per_step(self) -> float:
        """Mean payload bytes sent per optimizer step since attach (the initial broadcast excluded)."""
        bytes0, steps0 = getattr(self, "_attach_mark", (0, 0))
        return (self.comm.stats.bytes_sent - bytes0) / max(1, self.steps - steps0)

    def regroup(self) -> None:
        """Called by ``phalanx.elastic`` after the worker group was rebuilt with a new size.

        Strategies whose state depends on the world size (a divisor, a per-rank buffer) refresh it here.
        """

    def finish(self) -> None:
        """Collective, once when training ends: leave every replica holding the model to keep.

        Strategies whose replicas drift apart between syncs reconcile here (a last
        average, or EASGD's centre variable); synchronous ones have nothing to do.
        """

    # -- per-replica state (exact resume when replicas differ) ------------------------
    def replica_state_dict(self) -> dict[str, Any]:
        """This worker's own state that the other replicas do not share.

        By default: the compressor's residuals, when the strategy has a ``compression``.
        """
        compression = getattr(self, "compression", None)
        return {"compression": compression.state_dict()} if hasattr(compression, "state_dict") else {}

    def load_replica_state_dict(self, state: dict[str, Any]) -> None:
        if "compression" in state:
            self.compression.load_state_dict(state["compression"])

    def gather_state_dict(self) -> dict[str, Any]:
        """Collective (call on every rank): ``state_dict()`` plus every rank's replica state.

        A checkpoint written by rank 0 from this resumes each rank with its own
        residuals, parameters and optimizer state; see :meth:`load_state_dict`.
        """
        state = self.state_dict()
        mine = self.replica_state_dict()
        if self.comm.world_size > 1 and mine:
            state["replicas"] = self.comm.all_gather_state(_to_cpu(mine))
        return state

    def _load_replicas(self, state: dict[str, Any]) -> None:
        """Apply this rank's entry of ``state["replicas"]`` (written by :meth:`gather_state_dict`)."""
        replicas = state.get("replicas")
        if not replicas:
            return
        if len(replicas) != self.comm.world_size:
            warnings.warn(f"the checkpoint holds {len(replicas)} replicas but this run has {self.comm.world_size} "
                          "workers; every worker resumes from rank 0's shared state only, so the run will not "
                          "continue bit for bit.", stacklevel=3)
            return
        self.load_replica_state_dict(replicas[self.comm.rank])

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class Periodic(Strategy):
    """Local steps, then an exchange whenever the sync condition says so.

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
        return module

    def after_step(self) -> None:
        super().after_step()
        if self.sync(self.steps):
            self.exchange.exchange(self.params, self.comm)

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "exchange": self.exchange.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.exchange.load_state_dict(state["exchange"])
        self._load_replicas(state)

    def finish(self) -> None:
        """Exchange once more if local steps were taken since the last sync."""
        if self.steps and not self.sync(self.steps):
            self.exchange.exchange(self.params, self.comm)

    def replica_state_dict(self) -> dict[str, Any]:
        """Replicas differ between syncs, and so do their optimizers' states (momentum, Adam moments)."""
        return {**super().replica_state_dict(), "params": [p.detach().clone() for p in self.params],
                "optimizer": self.optimizer.state_dict()}

    def load_replica_state_dict(self, state: dict[str, Any]) -> None:
        super().load_replica_state_dict(state)
        with torch.no_grad():
            for p, saved in zip(self.params, state["params"], strict=True):
                p.copy_(saved)
        self.optimizer.load_state_dict(state["optimizer"])

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.sync!r}, {type(self.exchange).__name__})"


def _to_cpu(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_cpu(v) for v in obj)
    return obj


class ParameterAverage(Exchange):
    """Replace every replica's parameters by their mean (model averaging)."""

    def exchange(self, params: list[nn.Parameter], comm: Comm) -> None:
        comm.all_reduce_([p.data for p in params])
