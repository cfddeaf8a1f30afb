"""The synchronous parameter server: every worker's gradients summed on the servers each step, and
``px.ParameterServer(sync=...)``, which names it or Downpour.

Example (one worker, a colocated server in this process):
    >>> import torch, phalanx as px
    >>> net = torch.nn.Linear(4, 2)
    >>> model, opt = px.wrap(net, torch.optim.SGD(net.parameters(), lr=0.1), strategy=px.ParameterServer())
    >>> opt.zero_grad(); model(torch.randn(8, 4)).sum().backward(); opt.step()
    >>> px.strategy_of(opt).finish()
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..errors import ConfigError, usage
from ..group import group
from ..strategies.allreduce import rebuilt
from ..strategies.gradients import local_grads, set_averaged_grads_
from .client import ParamTable
from .downpour import Downpour
from .link import follow_group
from .shards import Policy
from .strategy import PSStrategy


class SyncParameterServer(PSStrategy):
    """Synchronous PS: each step the servers average all workers' gradients; your optimizer steps.

    Workers start from rank 0's parameters and all apply the same mean gradient, so the
    result equals ``px.AllReduce()`` for any optimizer. Here the servers act as reducers:
    the weights live on the workers. Gradients are averaged inside ``backward()``, so
    gradient clipping and GradScaler see the mean, as under AllReduce. A dead worker stops
    the others: the servers abandon the round it never joined after ``PHALANX_PS_TIMEOUT``
    and tell the waiting workers, which raise :class:`~phalanx.ps.client.PSError` naming it.
    Under ``--elastic`` they regroup instead (see :meth:`regroup`).
    """

    name = "ps-sync"
    uneven_batches = True  # the servers average batch-weighted gradients, as AllReduce does
    servers_hold_the_model = False  # the servers only reduce; the weights live on the workers

    def attach(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> nn.Module:
        # Replicas start identical, as under AllReduce: a one-off collective at attach, never per step.
        self.comm.broadcast_([t.data for t in model.state_dict(keep_vars=True).values()])
        return super().attach(model, optimizer)

    def join(self) -> None:
        # The servers only average, but they accept a tensor only under a registered name and shape.
        self.table.register(Policy(None))  # type: ignore[union-attr]

    def weighs_gradients(self, step: int) -> bool:
        return True

    def after_backward(self, step: int) -> None:
        """Inside ``backward()``: replace every gradient by the mean over all workers (batch-weighted).

        Non-finite gradients are averaged like any other, so when GradScaler finds inf on one
        rank, every rank sees it in the mean and skips that step, as under ``px.AllReduce``.
        """
        # Weighted by this rank's batch share as backward accumulated them (phalanx.step.clock). The flags say which
        # parameters had a gradient here; one no rank reached keeps grad None, as in one process.
        grads, flags = local_grads(self.params)
        g = group.current()  # under --elastic a round belongs to one generation; a dead peer ends the wait
        elastic = {"generation": g.generation,
                   "abandon": lambda: _lost(g) or self.server_restarted()} if rebuilt(g) else {}
        self._exchange(self.table.reduce, grads, step=step - 1,  # type: ignore[union-attr]
                       workers=group.world_size(), **elastic)
        self.comm.all_reduce_([flags])  # a few bytes over the workers' own group (the servers take named tensors)
        set_averaged_grads_(self.params, grads, flags)

    def regroup(self) -> None:
        """Under ``--elastic``: rounds now count the new group; colocated servers follow it (re-placed)."""
        link = follow_group(self.link, self.servers, self.timeout)  # type: ignore[arg-type]
        if link is not self.link:
            named = [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]
            self.link, self.table = link, ParamTable(named, link.client, self.placement)
            self._exchange(self.join)
        else:
            self._servers_back(register=True)  # a restarted server must know the names again

    def __repr__(self) -> str:
        return "ParameterServer(sync=True)"


def _lost(g: group.Group) -> str | None:
    """Why a member of the current generation will never send its part of a synchronous round, or None."""
    lost = g.lost_peers()
    if not lost:
        return None
    return (f"rank(s) {', '.join(map(str, lost))} of generation {g.generation} died during a synchronous "
            "parameter-server round")


def ParameterServer(sync: bool = True, **kwargs: Any) -> PSStrategy:  # noqa: N802 - reads as a strategy class
    """``sync=True``: :class:`SyncParameterServer`; ``sync=False``: ``Downpour(push_every=1, pull_every=1)``.

    Keyword arguments go to that class (``servers``, ``placement``, ``timeout``; the
    asynchronous one also takes Downpour's).
    """
    if not sync:
        return Downpour(1, 1, **kwargs)
    if set(kwargs) - {"servers", "placement", "timeout"}:
        raise ConfigError(usage(f"ParameterServer(sync=True, {', '.join(sorted(kwargs))}=...)",
                                "only servers, placement and timeout in synchronous mode",
                                "Use px.Downpour(...) for asynchronous knobs."))
    return SyncParameterServer(**kwargs)


__all__ = ["ParameterServer", "SyncParameterServer"]
