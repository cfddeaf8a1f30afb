"""DiLoCo: local steps with the user's optimizer, then an outer Nesterov step on the average change.

Douillard et al. 2023 ("DiLoCo: Distributed Low-Communication Training of Language
Models"): every worker runs H inner steps (their inner optimizer is AdamW) from a
shared anchor. The pseudo-gradient ``anchor - weights`` is averaged across workers,
an outer SGD step with Nesterov momentum (lr 0.7, momentum 0.9) moves the anchor,
and the new anchor becomes every worker's weights. With H = 500 it matched
synchronous training on 8 workers with 500x less communication; OpenDiLoCo found
that averaging the pseudo-gradient in fp16 loses nothing.

Example:
    >>> import phalanx as px
    >>> px.DiLoCo(every=100, compression=px.FP16())
    DiLoCo(every(100), outer_lr=0.7, outer_momentum=0.9, nesterov=True, compression=FP16())
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..group.collectives import Comm
from .compression import Compressor, check_compressor
from .. import check
from .sync import as_condition
from .base import Exchange, Periodic, load_rows
from .gradients import share_total, share_weighted_mean_
from .sparseloco import outer_defaults


def _outer_dtype(p: torch.Tensor) -> torch.dtype:
    return torch.float32 if p.dtype in (torch.float16, torch.bfloat16) else p.dtype


def outer_direction(d: torch.Tensor, buf: torch.Tensor, momentum: float, nesterov: bool) -> torch.Tensor:
    """torch.optim.SGD's step direction for gradient ``d`` (dampening 0); moves the momentum buffer ``buf``.

    Example:
        >>> d, buf = torch.ones(2), torch.zeros(2)
        >>> outer_direction(d, buf, 0.9, nesterov=True).tolist(), buf.tolist()
        ([1.899999976158142, 1.899999976158142], [1.0, 1.0])
    """
    if not momentum:
        return d
    buf.mul_(momentum).add_(d)
    return d.add(buf, alpha=momentum) if nesterov else buf


class OuterStep(Exchange):
    """Average ``anchor - params``, take an outer (Nesterov) SGD step on the anchor, copy it into params."""

    def __init__(self, lr: float, momentum: float, nesterov: bool, compression: Compressor | None) -> None:
        self.lr, self.momentum, self.nesterov, self.compression = lr, momentum, nesterov, compression
        self.anchor: list[torch.Tensor] = []
        self.buffers: list[torch.Tensor] = []
        self.share = 0.0  # this replica's samples since the last round, in batch weights (DiLoCo adds them)

    def setup(self, params: list[nn.Parameter], comm: Comm) -> None:
        # fp32 for bf16/fp16 models: inner steps of size ~lr*grad vanish against a half-precision anchor.
        self.anchor = [p.detach().to(_outer_dtype(p), copy=True) for p in params]
        self.buffers = [torch.zeros_like(a) for a in self.anchor]

    @torch.no_grad()
    def exchange(self, params: list[nn.Parameter], comm: Comm, step: int) -> None:
        for a, buf, d, p in zip(self.anchor, self.buffers, self._mean_delta(params, comm), params, strict=True):
            a.sub_(outer_direction(d, buf, self.momentum, self.nesterov), alpha=self.lr)
            p.copy_(a)

    @torch.no_grad()
    def average(self, params: list[nn.Parameter], comm: Comm) -> None:
        """Every replica and the anchor become the replicas' (share-weighted) mean; the outer momentum stays."""
        for a, d, p in zip(self.anchor, self._mean_delta(params, comm), params, strict=True):
            a.sub_(d)
            p.copy_(a)

    def _mean_delta(self, params: list[nn.Parameter], comm: Comm) -> list[torch.Tensor]:
        delta = [a - p.to(a.dtype) for a, p in zip(self.anchor, params, strict=True)]  # the pseudo-gradient
        # Each replica's pseudo-gradient counts by its share of the round's samples (outer_lr 1 and no momentum
        # is LocalSGD, whose average weights the same way); equal shares give the plain mean.
        share, self.share = self.share, 0.0
        if self.compression is not None:
            total = share_total(comm, share)  # known before compressing: one scalar
            weight = share * comm.world_size / total if total > 0 else 1.0
            if weight != 1.0:
                for d in delta:
                    d.zero_() if weight == 0 else d.mul_(weight)
            self.compression.average_(delta, comm, key="pseudo")
        else:
            share_weighted_mean_(delta, comm, share)
        return delta

    def state_dict(self) -> dict[str, Any]:
        return {"anchor": [a.clone() for a in self.anchor], "momentum": [b.clone() for b in self.buffers]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.anchor = load_rows(self.anchor, state["anchor"])
        self.buffers = load_rows(self.buffers, state["momentum"])

    def row_state(self) -> dict[str, list[torch.Tensor]]:
        """Per parameter: the anchor and the outer momentum (a sharded model: this rank's rows of each)."""
        return {"anchor": self.anchor, "momentum": self.buffers}

    def load_row_state(self, state: dict[str, list[torch.Tensor]]) -> None:
        """After a reshard: the new layout's rows. A compressor's error-feedback residuals start empty: each is one
        rank's flat vector over its old rows, cut into the compressor's chunks of that layout (as a joiner's, or a
        restore onto another world size, they are dropped: what the residuals had not sent yet is lost)."""
        self.anchor, self.buffers = list(state["anchor"]), list(state["momentum"])
        if self.compression is not None:
            self.compression.load_replica_state_dict({})


class DiLoCo(Periodic):
    """Inner steps with your optimizer; every ``every`` steps an outer Nesterov step on the averaged change.

    Args:
        every: inner steps per round (H; the paper uses 50-500), or any sync condition.
        outer_lr: the outer SGD learning rate (0.7 in the paper; 1.0 with ``px.SparseLoCo``).
        outer_momentum: the outer momentum in [0, 1) (0.9 in the paper; 0 with ``px.SparseLoCo``, whose
            error-feedback accumulator replaces it).
        nesterov: Nesterov momentum for the outer step (as in the paper).
        compression: a compressor for the pseudo-gradient, e.g. ``px.FP16()``, ``px.PowerSGD(rank=4)`` or
            ``px.SparseLoCo()`` (chunked top-k, 2-bit values, error feedback: arXiv 2508.15706).

    The anchor and the outer momentum are identical on every worker, live in
    ``state_dict``, and are kept in fp32 for fp16/bf16 models.
    ``DiLoCo(every=k, outer_lr=1, outer_momentum=0)`` is ``LocalSGD(every=k)``.
    :meth:`finish` after a partial round leaves every replica on the replicas' mean, not on an
    outer step: Nesterov's look-ahead would add 0.81x the last round's momentum to a
    pseudo-gradient of a few steps, and overshoot (docs/strategies.md).
    """

    name = "diloco"
    uneven_batches = True  # the pseudo-gradients are weighted by each replica's samples since the last round

    def __init__(self, every: Any = 50, outer_lr: float | None = None, outer_momentum: float | None = None,
                 nesterov: bool = True, compression: Any = None) -> None:
        outer_lr, outer_momentum = outer_defaults(compression, outer_lr, outer_momentum)
        outer_lr = check.positive_float("DiLoCo(outer_lr", outer_lr, "The paper uses outer_lr=0.7; outer_lr=1 "
                                        "with no momentum is plain averaging.", close=")")
        outer_momentum = check.number("DiLoCo(outer_momentum", outer_momentum, "The paper uses 0.9; 0 turns the "
                                      "outer momentum off.", low=0, high=1, low_open=False, close=")")
        self.compression = check_compressor(compression, "DiLoCo")
        super().__init__(as_condition(every), OuterStep(float(outer_lr), float(outer_momentum), bool(nesterov),
                                                        self.compression))

    def after_step(self, step: int, taken: bool) -> None:
        self.exchange.share += self.clock.step_weight  # a skipped step still held its samples
        super().after_step(step, taken)

    def reconcile(self) -> None:
        """A partial round since the last outer step: every replica takes the replicas' mean (see the class)."""
        if self.steps and not self.sync(self.steps):
            self.exchange.average(self.params, self.comm)
            self.running_stats.average_(self.comm)

    def replica_state_dict(self) -> dict[str, Any]:
        return {**super().replica_state_dict(), "share": self.exchange.share}

    def load_replica_state_dict(self, state: dict[str, Any]) -> None:
        super().load_replica_state_dict(state)
        self.exchange.share = float(state.get("share", 0.0))

    @property
    def anchor(self) -> list[torch.Tensor]:
        """The shared weights of the last round (identical on every worker)."""
        return self.exchange.anchor

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        if self.compression is not None:
            state["compression"] = self.compression.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "compression" in state:
            self.compression.load_state_dict(state["compression"])
        super().load_state_dict(state)

    def __repr__(self) -> str:
        x = self.exchange
        return (f"DiLoCo({self.sync!r}, outer_lr={x.lr}, outer_momentum={x.momentum}, nesterov={x.nesterov}, "
                f"compression={self.compression!r})")
