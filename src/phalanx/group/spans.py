"""Named spans of a step: how the core marks its parts for the timeline, without the profiler.

``with span("phalanx/exchange"):`` around a part of a step names it in the current group's
timeline (:class:`phalanx.step.profiling.Timeline`, made by ``phalanx run --profile`` or
``px.profile``) and costs one attribute read when none records. The collectives, the step
clock, the loader and checkpoints take spans; the timeline that records them, writes each
rank's trace and gathers them into one lives in :mod:`phalanx.step.profiling`, which uses the
collectives: keeping the spans here is what lets :mod:`phalanx.group.collectives` take spans without
importing the profiler.

Example:
    >>> with span("phalanx/exchange"):
    ...     pass
"""
from __future__ import annotations

import contextlib
from typing import Any, ContextManager, Protocol

from torch.autograd.profiler import record_function

from . import group
from .records import Record, Slot


class Recorder(Protocol):
    """What a span needs of the timeline that records it (:class:`phalanx.step.profiling.Timeline` is one)."""

    recording: bool
    _stopping: bool

    def span(self, name: str) -> ContextManager[Any]: ...
    def step(self, step: int) -> None: ...
    def _stop(self) -> None: ...
    def close(self) -> None: ...


class Recording(Slot[Recorder]):
    """The group's record of the timeline its spans go to (``None`` while nothing records)."""

    def before_leaving(self, failing: bool) -> None:
        """Write the timeline (collective) while the group is still up; not on an error: peers may be gone."""
        if self.value is not None and not failing:
            self.value.close()  # a no-op once written


TIMELINE: Record[Recording] = Record("timeline", Recording)

SPANS = ("phalanx/data wait", "phalanx/forward+backward", "phalanx/exchange", "phalanx/bucket",
         "phalanx/optimizer step", "phalanx/exchange after step", "phalanx/commit", "phalanx/checkpoint",
         "phalanx/clock sync")
#: The spans that tile a step (never nested in one another): their sum is the step's time in phalanx and the model.
TOP_LEVEL = ("phalanx/data wait", "phalanx/forward+backward", "phalanx/optimizer step",
             "phalanx/exchange after step", "phalanx/commit", "phalanx/checkpoint", "phalanx/clock sync")
_OFF: ContextManager[Any] = contextlib.nullcontext()  # stateless: shared by every span taken while not recording


def active() -> Recorder | None:
    """The current group's timeline, or None (cheap: read on every span)."""
    return TIMELINE.of(group.current()).value if group.is_initialized() else None


def span(name: str) -> ContextManager[Any]:
    """``with span("phalanx/..."):`` names that part of the step in the timeline; free when none is recording."""
    timeline = active()
    return timeline.span(name) if timeline is not None else _OFF


def step_closed(step: int) -> None:
    """The step clock closed ``step``: move the timeline's window (a no-op when there is none)."""
    timeline = active()
    if timeline is not None:
        timeline.step(step)


class Spans:
    """Spans opened in one hook and closed in another (forward pre-hook to end of backward), on one thread."""

    def __init__(self) -> None:
        self.open: dict[str, Any] = {}

    def begin(self, name: str) -> None:
        """Open ``name`` unless it is open already (or nothing records)."""
        timeline = active()
        if timeline is not None and timeline._stopping:
            timeline._stop()  # the step after the window begins here
        if name in self.open or timeline is None or not timeline.recording:
            return
        rf = record_function(name)
        rf.__enter__()
        self.open[name] = rf

    def end(self, name: str) -> None:
        """Close ``name`` if it is open."""
        rf = self.open.pop(name, None)
        if rf is not None:
            rf.__exit__(None, None, None)


__all__ = ["TIMELINE", "Recorder", "Recording", "SPANS", "TOP_LEVEL", "Spans", "active", "span", "step_closed"]
