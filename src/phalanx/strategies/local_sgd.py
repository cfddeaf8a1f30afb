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
from .sync import as_condition, is_synchronous, schedule
from .base import ParameterAverage, Periodic
from .gradients import average_gradients_, share_weighted_mean_


class LocalSGD(Periodic):
    """Local steps with the user's optimizer, then parameter averaging.

    Args:
        every: local steps between averages (an int), or any sync condition,
            e.g. ``px.schedule(sync_steps=500, then=px.every(8))``.
        warmup_steps: synchronous gradient averaging for this many steps first
            (post-local SGD); the same as ``every=px.schedule(warmup_steps, then=every)``.
            The warm-up averages gradients by the end of ``backward()``, as ``px.AllReduce`` does.

    Optimizer state (momentum, Adam moments) stays local to each worker, as in the papers.

    The average weights each replica by its share of the samples trained since the last
    one (the sum of its steps' batch weights, :mod:`phalanx.step.clock`): equal shares give the
    plain mean; on a short last global batch ``every=1`` is then ``px.AllReduce`` with plain
    SGD, and a worker that held no samples does not halve the others' update.
    """

    name = "local-sgd"
    uneven_batches = True  # the average weights each replica by its samples since the last one

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
        self.share = 0.0  # this replica's samples since the last average, in batch weights

    def weighs_gradients(self, step: int) -> bool:
        return is_synchronous(self.sync, step)  # the warm-up averages gradients; local steps keep their own

    def on_shards(self) -> bool:
        return not is_synchronous(self.sync, 1)  # the warm-up averages gradients, which FSDP holds as shards

    def after_backward(self, step: int) -> None:
        if is_synchronous(self.sync, step):  # the warm-up: plain synchronous SGD, averaged inside backward()
            average_gradients_(self.params, self.comm)

    def after_step(self, step: int, taken: bool) -> None:
        if is_synchronous(self.sync, step):
            return
        self.share += self.clock.step_weight  # a skipped step still held its samples: shares stay equal
        if self.sync(step):
            self._average()

    def _average(self) -> None:
        share_weighted_mean_([p.data for p in self.params], self.comm, self.share)
        self.running_stats.average_(self.comm)
        self.share = 0.0

    def reconcile(self) -> None:
        """Average once more if local steps were taken since the last average."""
        if self.steps and not self.sync(self.steps) and not is_synchronous(self.sync, self.steps):
            self._average()

    def replica_state_dict(self) -> dict[str, Any]:
        return {**super().replica_state_dict(), "share": self.share}

    def load_replica_state_dict(self, state: dict[str, Any]) -> None:
        super().load_replica_state_dict(state)
        self.share = float(state.get("share", 0.0))

    def __repr__(self) -> str:
        return f"LocalSGD({self.sync!r})"
