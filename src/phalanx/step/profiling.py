"""A timeline of where each step's time goes: a ``torch.profiler`` trace per rank, and one merged.

``phalanx run --profile DIR`` (or ``px.profile(DIR)`` in your own script) records a
bounded window of steps on every worker: ``skip`` steps are left out (warm-up), then
``steps`` steps are recorded. The step clock of the wrapped model drives the profiler's
schedule, so the loop never calls ``prof.step()``. phalanx names its own parts of a step:

* ``phalanx/data wait``: ``px.shard``'s loader producing the next batch;
* ``phalanx/forward+backward``: from the model's forward to the end of ``backward()``,
  with the gradient exchange inside it (``phalanx/exchange``; one ``phalanx/bucket``
  per DDP bucket sent; ``phalanx/all_reduce`` and the like for each collective);
* ``phalanx/optimizer step``, then ``phalanx/exchange after step`` (rules that exchange
  after it: local SGD, DiLoCo, EASGD, parameter servers), with the collectives inside;
* ``phalanx/commit`` (``px.elastic``) and ``phalanx/checkpoint`` (``px.save_checkpoint``);
* ``phalanx/clock sync``: one barrier at the end of the window, used to align the ranks' clocks.

These top-level spans do not overlap; together they cover the step up to the user's
own code between them. Each rank writes ``DIR/rank{r}.json``; rank 0 also writes
``DIR/timeline.json``, every rank's events on one time axis, one row (process) per rank.
Both are Chrome-trace JSON: open them at https://ui.perfetto.dev or ``chrome://tracing``.
The files are written at the step after the window (or at ``px.shutdown()`` when the
run ends first), so the window's own steps do not pay for the writing.

Example (tests/step/test_profiling.py runs it; starting the profiler takes seconds):
    >>> import tempfile, torch, phalanx as px
    >>> net = torch.nn.Linear(4, 2)
    >>> model, opt = px.wrap(net, torch.optim.SGD(net.parameters(), lr=0.1))
    >>> timeline = px.profile(tempfile.mkdtemp(), steps=2, skip=1)  # doctest: +SKIP
    >>> for _ in range(4):
    ...     opt.zero_grad(); model(torch.randn(8, 4)).sum().backward(); opt.step()
    >>> sorted(p.name for p in timeline.written)  # doctest: +SKIP
    ['rank0.json', 'timeline.json']
"""
from __future__ import annotations

import atexit
import json
import os
import warnings
from pathlib import Path
from typing import Any, ContextManager

import torch
from torch.autograd.profiler import record_function
from torch.profiler import ProfilerActivity, schedule
from torch.profiler import profile as torch_profile

from .. import check
from ..group import group
from ..group.collectives import barrier, gather_object
from ..errors import usage
from ..group.spans import _OFF, SPANS, TIMELINE, TOP_LEVEL, Spans, active, span, step_closed  # noqa: F401 (re-exported)

MERGED = "timeline.json"


class Timeline:
    """One rank's profiler over a window of steps; made by :func:`profile` (or ``phalanx run --profile``).

    ``written`` lists the files written so far (empty until the window is over).
    """

    def __init__(self, directory: Path, *, steps: int, skip: int) -> None:
        self.directory, self.steps, self.skip = directory, steps, skip
        self.rank = group.rank()  # kept: the group may be gone when the trace is written at exit
        self.written: list[Path] = []
        self.seen = 0  # the last clock step that moved the schedule
        self._stopping = False  # the window's last step closed: the profiler stops as the next step begins
        self._ready = False  # the window is over; its trace waits for the next step to be written
        self._done = False
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
        warmup = 1 if skip else 0  # the profiler warms up on the last skipped step
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch warns about a zero warm-up
            self.prof = torch_profile(activities=activities,
                                      schedule=schedule(wait=max(skip - 1, 0), warmup=warmup, active=steps, repeat=1),
                                      on_trace_ready=self._on_ready)
            self.prof.start()
        atexit.register(self.close)  # after px.init()'s own exit handler was registered, so it runs first

    @property
    def recording(self) -> bool:
        """True while the steps of the window (and the warm-up step before it) run: spans are taken then."""
        return not self._done and not self._ready and self.skip - 1 <= self.seen < self.skip + self.steps

    def span(self, name: str) -> ContextManager[Any]:
        """A named span in the trace while recording; a no-op context otherwise."""
        if self._stopping:
            self._stop()
        return record_function(name) if self.recording else _OFF

    def _stop(self) -> None:
        """End the window: stopping the profiler takes tens of milliseconds, charged to the step after it."""
        self._stopping = False
        self.prof.step()

    def step(self, step: int) -> None:
        """Called by the step clock when step ``step`` closes (every wrapped model: the first moves the schedule)."""
        if self._done:
            return
        if self._stopping:
            self._stop()
        if self._ready:
            self.close()
            return
        if step <= self.seen:
            return
        self.seen = step
        if step == self.skip + self.steps:  # the window's last step: a barrier whose end every rank shares
            with record_function("phalanx/clock sync"):
                if group.world_size() > 1:
                    barrier()
            self._stopping = True  # not now: the window's last step would pay for it
            return
        self.prof.step()

    def _on_ready(self, _prof: Any) -> None:
        self._ready = True

    def close(self) -> None:
        """Stop profiling and write the traces (collective when the group is up): idempotent.

        Called at the step after the window, by ``px.shutdown()``, and at exit.
        """
        if self._done:
            return
        self._done = True
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            self.prof.stop()  # a window cut short by the end of training is written as far as it got
        g = group.current() if group.is_initialized() else None
        rank = g.rank if g is not None else self.rank
        mine = self.directory / f"rank{rank}.json"
        try:
            self.prof.export_chrome_trace(str(mine))
            self.written.append(mine)
        except (OSError, RuntimeError) as err:  # the directory went away: training goes on
            warnings.warn(f"phalanx: the timeline could not be written to {mine}: {err}", stacklevel=2)
            return
        if g is None or g.world_size == 1 or g.failed is not None:
            traces = [mine.read_text()]
        else:
            traces = gather_object(mine.read_text(), 0, "the timeline")
        if rank == 0 and traces is not None:
            merged = self.directory / MERGED
            merged.write_text(json.dumps(merge([json.loads(t) for t in traces])))
            self.written.append(merged)


def merge(traces: list[dict[str, Any]]) -> dict[str, Any]:
    """One Chrome trace from every rank's (in rank order): rank r's events are process r, on rank 0's clock.

    Each rank's clock is shifted so that the end of its ``phalanx/clock sync`` barrier
    meets rank 0's (they left the barrier together, give or take one message). A rank's
    other processes (a GPU's rows) get ids ``1000 + 100 * r + i``.

    Example:
        >>> t = lambda pid, ts: {"traceEvents": [{"ph": "X", "name": "phalanx/clock sync", "pid": pid, "tid": 1,
        ...                                       "ts": ts, "dur": 1}]}
        >>> m = merge([t(11, 100.0), t(22, 40.0)])
        >>> [(e["pid"], e["ts"]) for e in m["traceEvents"] if e["ph"] == "X"]
        [(0, 100.0), (1, 100.0)]
    """
    ends = [_sync_end(t) for t in traces]
    events: list[dict[str, Any]] = []
    shifts: list[float] = []
    for r, trace in enumerate(traces):
        shift = (ends[0] - ends[r]) if ends[0] is not None and ends[r] is not None else 0.0
        shifts.append(shift)
        own = trace.get("traceEvents", [])
        main = _main_pid(own)
        ids: dict[Any, int] = {main: r}
        for e in own:
            pid = e.get("pid")
            if pid not in ids:
                ids[pid] = 1000 + 100 * r + len(ids)
            e = {**e, "pid": ids[pid]}
            if isinstance(e.get("ts"), (int, float)) and e.get("ph") != "M":
                e["ts"] = e["ts"] + shift
            if e.get("ph") == "M" and e.get("name") in ("process_name", "process_sort_index"):
                continue  # named below, by rank
            events.append(e)
        for pid, new in ids.items():
            name = f"rank {r}" if new == r else f"rank {r} ({pid})"
            events.append({"ph": "M", "name": "process_name", "pid": new, "tid": 0, "args": {"name": name}})
            events.append({"ph": "M", "name": "process_sort_index", "pid": new, "tid": 0,
                           "args": {"sort_index": new}})
    base = {k: v for k, v in (traces[0] if traces else {}).items() if k != "traceEvents"}
    return {**base, "traceEvents": events, "traceName": MERGED,
            "phalanx": {"ranks": len(traces), "clock_shift_us": shifts}}


def _main_pid(events: list[dict[str, Any]]) -> Any:
    """The process id of the rank's own Python process: the one its phalanx spans ran in."""
    for e in events:
        if e.get("ph") == "X" and str(e.get("name", "")).startswith("phalanx/"):
            return e.get("pid")
    return next((e.get("pid") for e in events if isinstance(e.get("pid"), int)), None)


def _sync_end(trace: dict[str, Any]) -> float | None:
    ends = [e["ts"] + e.get("dur", 0) for e in trace.get("traceEvents", [])
            if e.get("ph") == "X" and e.get("name") == "phalanx/clock sync"]
    return max(ends) if ends else None


def profile(directory: str | os.PathLike[str], *, steps: int = 3, skip: int = 5) -> Timeline | None:
    """Record a timeline of ``steps`` steps after ``skip`` warm-up steps into ``directory``; see the module doc.

    Call it on every worker, before the loop (after ``px.init()``). Returns the
    :class:`Timeline`, or None when ``directory`` cannot be written: then one warning line
    says so and training goes on without a timeline.

    Example:
        >>> import phalanx as px
        >>> px.profile("/proc/no-such-dir")  # doctest: +SKIP
        UserWarning: phalanx: cannot write the timeline to /proc/no-such-dir ...; training without one. ...
    """
    steps = check.positive_int("px.profile(steps", steps, "Record a few steps, e.g. steps=3.", close=")")
    skip = check.integer("px.profile(skip", skip, "Skip the warm-up steps, e.g. skip=5 (0 records from the first).",
                         close=")")
    problem = unwritable(directory)
    if problem is not None:
        if group.rank() == 0:  # one line for the job, not one per worker
            warnings.warn(problem, stacklevel=2)
        return None
    g = group.init()  # a plain process gets its lasting group of one, which holds the timeline
    recording = TIMELINE.of(g)
    if recording.value is not None:
        recording.value.close()
    timeline = recording.value = Timeline(Path(directory), steps=steps, skip=skip)
    return timeline


def unwritable(directory: str | os.PathLike[str]) -> str | None:
    """None when ``directory`` can be created and written; otherwise the one line that says why not.

    Example:
        >>> unwritable("/proc/phalanx-timeline") is not None
        True
    """
    path = Path(directory)
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".phalanx-write-test-{os.getpid()}"
        probe.write_text("")
        probe.unlink()
    except OSError as err:
        return usage(f"phalanx: cannot write the timeline to {path} ({err.strerror or err})",
                     "a directory this worker can create and write", "Training goes on without a timeline; "
                     "pass a writable directory to --profile / px.profile().")
    return None


__all__ = ["MERGED", "SPANS", "TOP_LEVEL", "Spans", "Timeline", "active", "merge", "profile", "span", "step_closed",
           "unwritable"]
