"""When a step is taken, and when the run ends: two small objects for the stream loader.

A live stream does not deliver a global batch on demand. :class:`WaitFull` steps
only on a full global batch (``world_size * batch_size`` events); :class:`Deadline`
also steps on what has arrived once the oldest waiting event is ``seconds`` old
(at least one event per worker, the step then weighted by each worker's share).
Either way a pause in the producer takes no step at all: an empty step would
still move the optimizer's momentum.

:class:`Stop` ends the run after ``steps`` steps, ``seconds`` of wall time or
``idle_s`` without a new event; an end-of-stream marker always ends it.

Example:
    >>> from phalanx.stream.policy import Deadline, Stop, WaitFull
    >>> WaitFull().ready(have=63, want=64, waited_s=9.0, world_size=2)
    False
    >>> Deadline(0.5).ready(have=3, want=64, waited_s=0.6, world_size=2)
    True
    >>> Stop(steps=10).reached(steps=10, elapsed_s=1.0, idle_s=0.0)
    True
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from ..errors import ConfigError, usage


class WaitFull:
    """Step only on a full global batch: every step equals one process's batch of ``world_size * batch_size``."""

    def ready(self, *, have: int, want: int, waited_s: float, world_size: int) -> bool:
        return have >= want

    def __repr__(self) -> str:
        return "WaitFull()"


class Deadline:
    """Step on a full global batch, or on what arrived once the oldest waiting event is ``seconds`` old."""

    def __init__(self, seconds: float) -> None:
        if not (isinstance(seconds, (int, float)) and seconds > 0 and math.isfinite(seconds)):
            raise ConfigError(usage(f"Deadline({seconds!r})", "a positive number of seconds",
                                    "Pass e.g. Deadline(0.5), or WaitFull() to always wait for a full batch."))
        self.seconds = float(seconds)

    def ready(self, *, have: int, want: int, waited_s: float, world_size: int) -> bool:
        # At least one event per worker: a worker with none would have no loss to take a gradient of.
        return have >= want or (have >= world_size and waited_s >= self.seconds)

    def __repr__(self) -> str:
        return f"Deadline({self.seconds})"


@dataclass(frozen=True)
class Stop:
    """End after ``steps`` optimizer steps (counted across restarts), ``seconds`` of this run, or ``idle_s``
    seconds without a new event. An end-of-stream marker always ends the run."""

    steps: int | None = None
    seconds: float | None = None
    idle_s: float | None = None

    def __post_init__(self) -> None:
        for name in ("steps", "seconds", "idle_s"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, (int, float)) and not isinstance(value, bool)
                                          and value > 0):
                raise ConfigError(usage(f"Stop({name}={value!r})", "a positive number or None",
                                        f"Pass e.g. Stop({name}=100)."))

    def reached(self, *, steps: int, elapsed_s: float, idle_s: float) -> bool:
        return ((self.steps is not None and steps >= self.steps)
                or (self.seconds is not None and elapsed_s >= self.seconds)
                or (self.idle_s is not None and idle_s >= self.idle_s))
