"""Local SGD: take local steps, average the parameters every k of them.

Stich 2019 ("Local SGD converges fast and communicates little") shows that the
number of communication rounds can fall by up to sqrt(T) at the same rate. Lin
et al. 2020 ("Don't use large mini-batches, use local SGD") add a synchronous
warm-up, *post-local SGD*: average gradients every step while the loss falls fast,
then switch to local steps (they use H = 16).

Example:
    >>> import phalanx as px
    >>> px.LocalSGD(every=8, warmup_steps=100)
    LocalSGD(schedule(sync_steps=100, then=every(8)))
"""
from __future__ import annotations

import warnings
from typing import Any

from .. import check
from ..errors import ConfigError, usage
from ..sync import as_condition, is_synchronous, schedule
from .base import ParameterAverage, Periodic
from .gradients import average_gradients_


class LocalSGD(Periodic):
    """Local steps with the user's optimizer, then parameter averaging.

    Args:
        every: local steps between averages (an int), or any sync condition,
            e.g. ``px.schedule(sync_steps=500, then=px.every(8))``.
        warmup_steps: synchronous gradient averaging for this many steps first
            (post-local SGD); the same as ``every=px.schedule(warmup_steps, then=every)``.
            The warm-up averages gradients by the end of ``backward()``, as ``px.AllReduce`` does.

    Optimizer state (momentum, Adam moments) stays local to each worker, as in the papers.
    """

    name = "local-sgd"

    def __init__(self, every: Any = 8, warmup_steps: int = 0, *, compression: Any = None) -> None:
        if compression is not None:
            raise ConfigError(usage(
                f"LocalSGD(compression={compression!r})", "no compressor: LocalSGD averages parameters, and the "
                "compressors with error feedback are made for updates (gradients, pseudo-gradients)",
                "Use px.DiLoCo(every=k, outer_lr=1.0, outer_momentum=0.0, compression=...), which is local SGD "
                "sending the compressed parameter change, or px.AllReduce(compression=...)."))
        check.integer("LocalSGD(warmup_steps", warmup_steps,
                      "Pass the number of synchronous steps before local SGD starts, or 0.", close=")")
        sync = as_condition(every)
        if warmup_steps:
            sync = schedule(warmup_steps, then=sync)
        if every == 1 and not isinstance(every, bool):
            warnings.warn("LocalSGD(every=1) averages parameters after every step: with plain SGD that is "
                          "px.AllReduce() without AllReduce's overlap of communication and backward. Use "
                          "px.AllReduce(), or every > 1 to communicate less.", UserWarning, stacklevel=2)
        super().__init__(sync, ParameterAverage())

    def weighs_gradients(self, step: int) -> bool:
        return is_synchronous(self.sync, step)  # the warm-up averages gradients; local steps keep their own

    def after_backward(self, step: int) -> None:
        if is_synchronous(self.sync, step):  # the warm-up: plain synchronous SGD, averaged inside backward()
            average_gradients_(self.params, self.comm)

    def after_step(self, step: int, taken: bool) -> None:
        if not is_synchronous(self.sync, step) and self.sync(step):
            self.exchange.exchange(self.params, self.comm, step)

    def __repr__(self) -> str:
        return f"LocalSGD({self.sync!r})"
