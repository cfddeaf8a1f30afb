"""Speed-balanced shares: each worker's part of a global batch, in proportion to its measured throughput.

**Workers of uneven speed** (``px.shard(..., balance="speed")``): the global batch keeps its size but is
split in proportion to each worker's measured throughput, so a synchronous step no
longer waits for the slowest worker to finish a full equal part. Every ``rebalance_every``
steps each worker reports the seconds per sample of its own work (its step time less the
time it waited for peers in the exchange, :attr:`phalanx.step.clock.StepClock.waited`); the
reports are all-gathered and the next global batches, still contiguous slices of the
shared epoch order, are cut in proportion to 1 / seconds per sample (each worker keeps at
least one sample; :func:`phalanx.data.sampler.split_sizes`). Every sample is still trained once
per epoch, and the batch weights keep each step one process's step on the same global batch.
Only strategies that weight workers by their share accept uneven parts (:class:`UnevenBatches`:
AllReduce, LocalSGD, DiLoCo, the synchronous parameter server); the split lives in the loader's
``state_dict`` (:class:`phalanx.data.loader.ShardedLoader`), and returns to equal after an elastic regroup.
"""
from __future__ import annotations

import math
from typing import Callable, Protocol, Sequence, runtime_checkable

from ..errors import ConfigError, usage
from ..step.clock import clocks


SpeedSource = Callable[[int, float], float]
"""This worker's seconds per sample, from the samples it trained and its busy seconds since the last call."""


def seconds_per_sample(samples: int, busy_s: float) -> float:
    """The default speed source: busy seconds over samples (nan before any sample, which keeps the split)."""
    return busy_s / samples if samples > 0 else math.nan


class SpeedBalance:
    """``px.shard(..., balance="speed")``'s measurement: busy time and samples since the split was last set.

    Example:
        >>> b = SpeedBalance(every=2)
        >>> for _ in range(2):
        ...     b.handed_out(8); b.worked(0.4)
        >>> b.due, b.measure()
        (True, 0.05)
    """

    def __init__(self, every: int, speed: SpeedSource | None = None) -> None:
        self.every, self.speed = every, speed or seconds_per_sample
        self.since = 0  # steps handed out since the split was last set
        self.samples, self.busy = 0, 0.0

    @property
    def due(self) -> bool:
        return self.since >= self.every

    def handed_out(self, samples: int) -> None:
        """A step's batch of ``samples`` went to this worker (counted at once: a loop may stop right after)."""
        self.since += 1
        self.samples += samples

    def worked(self, busy_s: float) -> None:
        """The seconds this worker spent on that batch, waiting for peers left out."""
        self.busy += max(busy_s, 0.0)

    def measure(self) -> float:
        """This worker's seconds per sample since the last measurement (``speed``'s answer); starts a new one."""
        value = float(self.speed(self.samples, self.busy))
        self.since, self.samples, self.busy = 0, 0, 0.0
        return value


def shares_from(seconds: Sequence[float]) -> list[float] | None:
    """Each worker's part of a global batch, in proportion to its throughput; None if a measurement is unusable.

    Example:
        >>> shares_from([0.01, 0.03]), shares_from([0.01, float("nan")])
        ([0.75, 0.25], None)
    """
    if not seconds or not all(math.isfinite(s) and s > 0 for s in seconds):
        return None
    rates = [1.0 / s for s in seconds]
    return [r / sum(rates) for r in rates]


@runtime_checkable
class UnevenBatches(Protocol):
    """A rule that weights each worker by its share of the global batch (the step clock's weight), so workers
    may hold parts of different sizes: ``uneven_batches = True`` on the rule. Others are refused beside
    ``balance="speed"``."""

    uneven_batches: bool


def refuse_unweighted_strategies() -> None:
    """Refuse ``balance="speed"`` beside a wrapped model whose strategy counts every worker alike."""
    for clock in list(clocks()):
        strategy = clock.strategy
        if strategy is not None and not (isinstance(strategy, UnevenBatches) and strategy.uneven_batches):
            raise ConfigError(usage(
                f"px.shard(..., balance='speed') with strategy {type(strategy).__name__}",
                "a strategy that weights each worker by its share of the global batch (px.AllReduce, px.LocalSGD, "
                "px.DiLoCo, px.ParameterServer(sync=True)): this one counts every worker alike, or has no global "
                "batch", "Drop balance=, or use px.AllReduce(); asynchronous rules (px.Downpour, px.AsyncEASGD) "
                "already let a fast worker run ahead."))


__all__ = ["SpeedBalance", "SpeedSource", "refuse_unweighted_strategies", "seconds_per_sample", "shares_from"]
