"""EASGD: an elastic force pulls every worker toward a centre variable (synchronous variant).

Zhang, Choromanska and LeCun 2015 ("Deep learning with Elastic Averaging SGD"),
eqs. 5-6 with communication period tau: every tau local steps, with ``p`` workers,

    x_i <- x_i - alpha * (x_i - c)          on every worker i
    c   <- c + alpha * sum_i (x_i - c)      (the x_i before the pull)

Workers explore on their own between syncs; the centre ``c`` is what you keep. The
paper recommends ``beta = p * alpha`` near 0.9. The centre update rewrites as
``c <- (1 - beta) c + beta * mean_i(x_i)``, a moving average of the workers only for
``0 < beta <= 1``: that is the range we accept, ``0 < alpha <= 1/p``. (The
elastic differences then contract by ``1 - alpha`` and ``1 - (p+1) alpha`` per sync,
both inside (-1, 1); from ``alpha >= 2/(p+1)`` on they grow and the run diverges.)

The centre is held, identical, on every worker (one all-reduce of the model per
sync), so no parameter server is needed. The paper's asynchronous variant, with the
centre on parameter servers, is ``px.AsyncEASGD``.

Example:
    >>> import phalanx as px
    >>> px.EASGD(every=4)          # alpha = 0.9 / p, the paper's beta = 0.9
    EASGD(every(4), alpha=None)
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..group.collectives import Comm
from .. import check
from ..errors import ConfigError, usage
from .sync import as_condition
from .base import Exchange, Periodic, load_rows

RECOMMENDED_BETA = 0.9  # the paper's beta = p * alpha


class Elastic(Exchange):
    """The symmetric elastic update of EASGD with a centre kept on every worker."""

    def __init__(self, alpha: float | None) -> None:
        self.alpha = alpha
        self.centre: list[torch.Tensor] = []

    def setup(self, params: list[nn.Parameter], comm: Comm) -> None:
        p = comm.world_size
        if self.alpha is None:
            self.alpha = RECOMMENDED_BETA / p
        elif p * self.alpha > 1:
            raise ConfigError(usage(
                f"EASGD(alpha={self.alpha}) with p={p} workers (beta = p*alpha = {p * self.alpha:g})",
                f"0 < alpha <= 1/p = {1 / p:g}, so that the centre update c <- (1-beta) c + beta mean(x) is a "
                "moving average (Zhang et al. 2015)", f"The paper uses beta = 0.9: alpha = {0.9 / p:g}; "
                "or leave alpha unset for that."))
        self.centre = [q.detach().clone() for q in params]

    @torch.no_grad()
    def exchange(self, params: list[nn.Parameter], comm: Comm, step: int) -> None:
        diffs = [x - c for x, c in zip(params, self.centre, strict=True)]
        for x, d in zip(params, diffs, strict=True):
            x.sub_(d, alpha=self.alpha)  # the elastic pull on each worker
        comm.all_reduce_(diffs, op="sum")
        for c, d in zip(self.centre, diffs, strict=True):
            c.add_(d, alpha=self.alpha)  # the symmetric force on the centre

    def state_dict(self) -> dict[str, Any]:
        return {"centre": [c.clone() for c in self.centre], "alpha": self.alpha}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.centre = load_rows(self.centre, state["centre"])

    def row_state(self) -> dict[str, list[torch.Tensor]]:
        """Per parameter: the centre (a sharded model: this rank's rows of it)."""
        return {"centre": self.centre}

    def load_row_state(self, state: dict[str, list[torch.Tensor]]) -> None:
        self.centre = list(state["centre"])


class EASGD(Periodic):
    """Synchronous elastic averaging SGD: local steps, an elastic pull toward the centre every ``every`` steps.

    Args:
        every: the communication period tau (the paper tries 1 to 64), or any sync condition.
        alpha: the elastic coefficient (the paper's eta * rho), in ``(0, 1/p]`` for ``p`` workers;
            by default ``0.9 / p`` (the paper's beta = p * alpha = 0.9).

    :meth:`finish` copies the centre into every worker's model: the centre is the result.
    """

    name = "easgd"

    def __init__(self, every: Any = 4, alpha: float | None = None, *, compression: Any = None) -> None:
        if compression is not None:
            raise ConfigError(usage(f"EASGD(compression={compression!r})", "no compressor: the elastic force needs "
                                    "the exact distance of every worker to the centre",
                                    "Use px.DiLoCo(compression=...) or px.AllReduce(compression=...) to compress."))
        if alpha is not None:
            check.number("EASGD(alpha", alpha, "Leave alpha unset for the paper's beta = 0.9, i.e. alpha = 0.9/p.",
                         low=0, high=1, high_open=False, close=")",
                         expected="0 < alpha <= 1/p for p workers (beta = p*alpha in (0, 1], Zhang et al. 2015)")
        super().__init__(as_condition(every), Elastic(None if alpha is None else float(alpha)))
        self._alpha_given = alpha

    @property
    def alpha(self) -> float | None:
        return self.exchange.alpha

    @property
    def centre(self) -> list[torch.Tensor]:
        """The centre variable (identical on every worker)."""
        return self.exchange.centre

    def regroup(self) -> None:
        """phalanx.elastic rebuilt the group: a default alpha follows the new p (beta stays 0.9, inside (0, 1]).

        A given alpha is kept: the user chose it (a grow beyond 1/alpha workers would then diverge).
        """
        if self._alpha_given is None:
            self.exchange.alpha = RECOMMENDED_BETA / self.comm.world_size

    @torch.no_grad()
    def reconcile(self) -> None:
        for x, c in zip(self.params, self.centre, strict=True):
            x.copy_(c)
        self.running_stats.average_(self.comm)

    def __repr__(self) -> str:
        return f"EASGD({self.sync!r}, alpha={self._alpha_given})"
