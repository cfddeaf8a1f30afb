"""Asynchronous EASGD (Zhang et al. 2015) on the parameter servers: the centre variable lives on the servers, and
each worker pulls itself towards it and pushes the elastic difference on its own schedule.

Example (one worker, a colocated server in this process):
    >>> import torch, phalanx as px
    >>> net = torch.nn.Linear(4, 2)
    >>> model, opt = px.wrap(net, torch.optim.SGD(net.parameters(), lr=0.1), strategy=px.AsyncEASGD())
    >>> opt.zero_grad(); model(torch.randn(8, 4)).sum().backward(); opt.step()
    >>> px.strategy_of(opt).finish()
"""
from __future__ import annotations

from typing import Any

from .. import check
from ..group import group
from ..strategies import sync
from .shards import Policy
from .strategy import PSStrategy


class AsyncEASGD(PSStrategy):
    """Asynchronous elastic averaging SGD (Zhang, Choromanska and LeCun 2015), centre on the servers.

    Every ``every`` local steps (τ), in one round trip per server: ``d = α(x − c)``,
    ``c ← c + d`` on the server, and ``x ← x − d`` on the worker. The trained model is the
    centre. :meth:`finish` loads it into the local model.

    Args:
        every: τ, local steps between elastic moves (the paper uses 1 to 64).
        alpha: the elastic force, 0 < α < 1; default 0.9 / number of workers (β = pα = 0.9).
        lock: serialise the centre's updates (the paper's asynchronous rule assumes it).
    """

    name = "easgd-async"

    def __init__(self, every: int = 4, alpha: float | None = None, *, lock: bool = True, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.when = sync.every(every)
        if alpha is not None:
            check.number("alpha", alpha, "The paper keeps alpha * workers near 0.9, e.g. alpha=0.45 for 2 workers.",
                         low=0, high=1, expected="0 < alpha < 1 (the elastic force)")
        self.alpha, self.lock = alpha, bool(lock)
        self._default_alpha = alpha is None  # then it follows the world size

    def join(self) -> None:
        if self._default_alpha:
            self.alpha = 0.9 / max(1, group.world_size())
        self.table.register(Policy(None, self.lock))  # type: ignore[union-attr]

    def regroup(self) -> None:
        """Under ``--elastic``, after a change: the default alpha follows the new p (beta = p * alpha stays 0.9)."""
        super().regroup()
        if self._default_alpha:
            self.alpha = 0.9 / max(1, group.world_size())

    def after_step(self, step: int, taken: bool) -> None:
        if self.when(step):
            self._exchange(self.table.easgd, self.alpha)  # type: ignore[union-attr]

    def __repr__(self) -> str:
        return f"AsyncEASGD(every={self.when.k}, alpha={self.alpha})"


__all__ = ["AsyncEASGD"]
