"""``px.Auto`` (``strategy="auto"``): measure the step and the link, then pick the rule and its settings.

During its first ``probe_steps`` steps the rule averages gradients (``px.AllReduce``, overlapped with
backward) and measures what :mod:`phalanx.step.clock` already counts: the wall time of a step and the
part of it spent waiting on the exchange (``clock.waited``). Then one timed all-reduce of up to 1 MiB
measures the rate the group's link achieves. From these:

* the compute step ``t_c`` = step − waiting;
* the rate ``B`` from the ring model ``T = 2(N−1)/N · S/B``;
* the overlap: the share of a full gradient all-reduce (``T`` for 4 bytes a parameter) that backward hid.

:func:`phalanx.strategies.decision.decide` then picks the rule and its settings by projected time to target
(step time × the planned steps × the rule's measured step penalty); ``phalanx bench``'s projection asks the
same function (:mod:`phalanx.bench.projection`).

It decides again after every regroup (``phalanx.elastic``) and when the rate, measured again every
``recheck_every`` steps, has changed by more than 2×. It changes rule only at a commit point where
both rules' state is defined: right after a full average (every step of AllReduce, a DiLoCo round, or
a full average of every Streaming DiLoCo fragment that it takes for the purpose). Each choice is
printed as one line on rank 0 and kept in :meth:`Auto.state_dict` (the schedule so far, the
measurement, the rule's own state), so a resume or a joiner follows the same schedule rather than
measuring again.

Example (the decision on synthetic measurements):
    >>> fast = Measurement(compute_s=0.06, grad_bytes=4e6, rate=1.25e9, overlap=0.5, workers=2)
    >>> decide(fast, planned_steps=200).choice.rule
    'allreduce'
    >>> slow = Measurement(compute_s=0.06, grad_bytes=4e6, rate=1.25e6, overlap=0.0, workers=2)
    >>> decide(slow, planned_steps=5000).choice.rule
    'streaming-diloco'
"""
from __future__ import annotations

import dataclasses
import math
import sys
import time
from typing import Any, Callable, Protocol, TextIO, runtime_checkable

import torch
from torch import nn

from .. import check
from ..errors import ConfigError, usage
from ..group import group
from ..step.protocols import replicas_agree, weighs_gradients
from .accounting import Accounting
from .allreduce import AllReduce, rebuilt
from .base import StepState, Strategy
from .diloco import DiLoCo
from .streaming_diloco import StreamingDiLoCo
from .decision import PROBE_BYTES, Choice, Decision, Measurement, decide


@runtime_checkable
class PlansLength(Protocol):
    """A rule that weighs the run's planned length (``Trainer.fit`` tells it ``epochs × len(loader)``)."""

    def plan(self, steps: int) -> None: ...


class Auto(Accounting, StepState, Strategy):
    """Measure the step and the link during the first steps, then train with the rule that projects the shortest
    time to target (module docstring); decide again after a regroup or a >2x change of the link's rate.

    Args:
        planned_steps: the run's length in optimizer steps (``len(loader) * epochs``); ``Trainer.fit`` tells it.
            Unknown: 10,000 is assumed, and the line says so.
        probe_steps: steps measured with AllReduce before the first decision (the first is a warm-up), >= 2.
        recheck_every: steps between two measurements of the link's rate (one small timed all-reduce).
        decider: the decision function (:func:`decide`); tests pass their own.
        out: where rank 0 prints its line (stderr).

    Example:
        >>> import torch, phalanx as px
        >>> net = torch.nn.Linear(4, 2)
        >>> model, opt = px.wrap(net, torch.optim.SGD(net.parameters(), lr=0.1), strategy=px.Auto(planned_steps=200))
    """

    name = "auto"

    def __init__(self, planned_steps: int | None = None, *, probe_steps: int = 3, recheck_every: int = 200,
                 decider: Callable[[Measurement, int | None], Decision] = decide, out: TextIO | None = None) -> None:
        super().__init__()
        if planned_steps is not None:
            check.positive_int("Auto(planned_steps", planned_steps, "Pass the run's length in optimizer steps, "
                               "e.g. planned_steps=len(loader) * epochs.", close=")")
        if isinstance(probe_steps, bool) or not isinstance(probe_steps, int) or probe_steps < 2:
            raise ConfigError(usage(f"Auto(probe_steps={probe_steps})", "2 or more (the first step is a warm-up)",
                                    "Pass probe_steps=3."))
        check.positive_int("Auto(recheck_every", recheck_every, "Pass e.g. recheck_every=200.", close=")")
        self.planned_steps, self.probe_steps, self.recheck_every = planned_steps, probe_steps, recheck_every
        self.decider, self.out = decider, out
        self.rule: Strategy | None = None
        self.running = Choice("plain")  # the rule in charge now (AllReduce while measuring)
        self.choice: Choice | None = None  # None: measuring
        self.start = 0  # the step the rule took over at
        self.schedule: list[dict[str, Any]] = []  # every choice so far: step, choice, the line
        self.measurement: Measurement | None = None
        self.pending: Choice | None = None  # decided, waiting for a commit point
        self.checked = 0  # the step the rate was last measured at
        self._probe: list[tuple[float, float]] = []
        self._regrouped = False
        self._decision: Decision | None = None  # the decision of the pending choice

    # -- the template ------------------------------------------------------------------------------------------
    def attach(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> nn.Module:
        module = super().attach(model, optimizer)
        if self.comm.world_size == 1 and not rebuilt(group.current()):
            self.choice = Choice("plain")
            self._say("phalanx auto: a group of one trains as a plain loop (nobody to exchange with); "
                      "nothing is measured")
            return module
        self._use(Choice("allreduce"), 0)
        return module

    def weighs_gradients(self, step: int) -> bool:
        return self.rule is not None and weighs_gradients(self.rule, step)

    def replicas_agree(self, step: int) -> bool:
        return self.rule is None or replicas_agree(self.rule, step)

    def after_backward(self, step: int) -> None:
        if self.rule is not None:
            self.rule.after_backward(step)

    def after_step(self, step: int, taken: bool) -> None:
        if self.rule is not None:
            self.rule.after_step(step, taken)
        if self.choice is None:  # measuring
            self._probe.append((time.perf_counter(), self.clock.waited))
            if len(self._probe) >= self.probe_steps:
                self.measurement = self._measure()
                self._decide(step, initial=True)
            return
        if self.measurement is not None and (self._regrouped or step - self.checked >= self.recheck_every):
            self._recheck(step)
        if self.pending is not None and self._commit_point(step):
            self._switch(self.pending, step)

    def finish(self) -> None:
        super().finish()
        if self.rule is not None:
            self.rule.finish()

    # -- measuring and deciding --------------------------------------------------------------------------------
    def _measure(self) -> Measurement:
        """The probe window's step and waiting, and one timed all-reduce: agreed on every rank (rank 0's mean)."""
        (t0, w0), (t1, w1) = self._probe[0], self._probe[-1]
        k = len(self._probe) - 1
        self._probe = []
        probe_bytes, probe_s = self._probe_link()
        vals = torch.tensor([(t1 - t0) / k, (w1 - w0) / k, probe_s], dtype=torch.float64)
        self.comm.all_reduce_([vals])
        self.comm.broadcast_([vals])  # the mean, bit for bit the same everywhere: every rank decides alike
        step_s, waited, probe_s = vals.tolist()
        grad_bytes = 4.0 * sum(p.numel() for p in self.params)
        m = Measurement(compute_s=max(step_s - waited, 1e-6), grad_bytes=grad_bytes, rate=1.0,
                        overlap=0.0, workers=self.comm.world_size, tensors=len(self.params))
        # ring_s at rate 1 is the bytes the ring moves; alone (an elastic group of one) nothing crossed a link: the
        # rate is unknown, taken as infinite until a probe among peers (after the group grows) measures it
        rate = m.ring_s(probe_bytes) / max(probe_s, 1e-9) if m.workers > 1 else math.inf
        m = dataclasses.replace(m, rate=rate)
        full = m.ring_s(grad_bytes)
        overlap = min(1.0, max(0.0, 1 - waited / full)) if full > 0 else 1.0
        return dataclasses.replace(m, overlap=overlap)

    def _probe_link(self) -> tuple[int, float]:
        """One timed all-reduce of up to 1 MiB (the gradient's size if smaller): the link's rate, in the ring model."""
        n = max(1, min(int(4 * sum(p.numel() for p in self.params)), PROBE_BYTES) // 4)
        buf = torch.ones(n, dtype=torch.float32, device=self.params[0].device)
        self.comm.all_reduce_([buf[:1]])  # both ranks at the probe: the timing starts together
        start = time.perf_counter()
        self.comm.all_reduce_([buf])
        return 4 * n, time.perf_counter() - start

    def _decide(self, step: int, *, initial: bool = False) -> None:
        assert self.measurement is not None
        decision = self.decider(self.measurement, self.planned_steps)
        if initial:
            self._switch(decision.choice, step, decision.line(step))
        elif _differs(decision.choice, self.running):
            self.pending, self._decision = decision.choice, decision  # its line names the step it takes over at
        else:
            self.pending = None  # the rate came back: the rule in charge is the right one again

    def _recheck(self, step: int) -> None:
        """After a regroup, or every ``recheck_every`` steps: measure the rate; decide again if it moved > 2x."""
        assert self.measurement is not None
        self.checked = step
        regrouped, self._regrouped = self._regrouped, False
        m = dataclasses.replace(self.measurement, workers=self.comm.world_size)
        rate = self._rate(m)
        moved = rate != m.rate and not (0.5 <= rate / m.rate <= 2.0)
        if moved:
            m = dataclasses.replace(m, rate=rate)
        if moved or regrouped:
            self.measurement = m
            self._decide(step)

    def _rate(self, m: Measurement) -> float:
        """The link's rate now, agreed on every rank (one probe); alone, nothing to probe: the last one stands."""
        if m.workers <= 1:
            return m.rate
        probe_bytes, probe_s = self._probe_link()
        vals = torch.tensor([probe_s], dtype=torch.float64)
        self.comm.all_reduce_([vals])
        self.comm.broadcast_([vals])
        return dataclasses.replace(m, rate=1.0).ring_s(probe_bytes) / max(float(vals[0]), 1e-9)

    def _commit_point(self, step: int) -> bool:
        """Right after a full average: every AllReduce step, a DiLoCo round; Streaming DiLoCo makes one (finish)."""
        rule = self.rule
        if isinstance(rule, DiLoCo):
            return bool(rule.sync(step))
        if isinstance(rule, StreamingDiLoCo):
            rule.finish()  # every fragment's in-flight exchange applied, then the replicas' mean everywhere
        return True

    def _switch(self, choice: Choice, step: int, line: str | None = None) -> None:
        self.pending = None
        if _differs(choice, self.running):
            self._use(choice, step)
        self.choice, self.checked = choice, step
        if line is None:
            line = self._decision.line(step) if self._decision is not None else ""
        self._decision = None
        self.schedule.append({"step": step, "choice": choice.state(), "line": line})
        self._say(line)

    def _use(self, choice: Choice, start: int) -> None:
        """Put ``choice``'s rule in charge from step ``start``: the old one's hooks come off, the new one attaches
        (collective: the same step on every rank) and shares this rule's comm and clock."""
        old = self.rule
        overlap = getattr(old, "_overlap", None)
        if overlap is not None:
            overlap.remove()
        rule = choice.build(start)
        self.rule, self.start, self.running = rule, start, choice
        if rule is None:
            return
        rule.comm, rule.clock = self.comm, self.clock  # one byte count, one step count
        if isinstance(rule, AllReduce):
            if old is not None and not isinstance(old, AllReduce):
                self._average_optimizer_state()
            rule.attach(self.model, self.optimizer, wrapper=False)  # no DDP module: the user's module stays
        else:
            rule.attach(self.model, self.optimizer)
        if isinstance(rule, StreamingDiLoCo):
            for f in rule.fragments:
                f.offset = (start + f.offset) % rule.every
                f.synced_at = start

    def _average_optimizer_state(self) -> None:
        """Leaving a rule whose replicas drift for AllReduce: the inner optimizers' states (momentum, Adam's
        moments) drifted with the replicas; from here every rank steps one model, so they take their mean."""
        states = [v for state in self.optimizer.state.values() for v in state.values()
                  if torch.is_tensor(v) and v.is_floating_point() and v.dim() > 0]
        self.comm.all_reduce_(states)

    def _say(self, line: str) -> None:
        if line and self.comm.rank == 0:
            print(line, file=self.out or sys.stderr, flush=True)

    # -- what the features ask ---------------------------------------------------------------------------------
    def plan(self, steps: int) -> None:
        """The run's length, from ``Trainer.fit`` (``epochs × len(loader)``) unless ``planned_steps`` was given."""
        if self.planned_steps is None:
            self.planned_steps = int(steps)

    def regroup(self) -> None:
        """The group was rebuilt: the rule forgets what was in flight, and Auto decides again at the next step."""
        if self.rule is not None and hasattr(self.rule, "regroup"):
            self.rule.regroup()
        self._regrouped = self.measurement is not None  # a group of one from the start measured nothing: stays plain

    # -- state ------------------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The schedule so far, the current choice and since when, the measurement, and the rule's own state."""
        m = self.measurement
        return {"choice": None if self.choice is None else self.choice.state(), "start": self.start,
                "schedule": [dict(s) for s in self.schedule], "checked": self.checked,
                "measurement": None if m is None else dataclasses.asdict(m),
                "pending": None if self.pending is None else self.pending.state(),
                "rule": self.rule.state_dict() if self.rule is not None else {}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Follow the saved schedule: the saved rule, from the step it took over at (its attach is collective where
        every rank loads, as on a resume; a joiner entering alone attaches alone)."""
        choice = None if state["choice"] is None else Choice.from_state(state["choice"])
        start = int(state["start"])
        if choice is not None and (_differs(choice, self.running) or start != self.start):
            self._use(choice, start)
        self.choice, self.start, self.checked = choice, start, int(state["checked"])
        self.schedule = [dict(s) for s in state["schedule"]]
        self.measurement = None if state["measurement"] is None else Measurement(**state["measurement"])
        self.pending = None if state["pending"] is None else Choice.from_state(state["pending"])
        self._probe = []
        if self.rule is not None:
            self.rule.load_state_dict(state["rule"])

    def replica_state_dict(self) -> dict[str, Any]:
        fn = getattr(self.rule, "replica_state_dict", None)
        return {"rule": fn()} if fn is not None else {}

    def load_replica_state_dict(self, state: dict[str, Any]) -> None:
        fn = getattr(self.rule, "load_replica_state_dict", None)
        if fn is not None and "rule" in state:
            fn(state["rule"])

    def __repr__(self) -> str:
        now = "measuring" if self.choice is None else self.choice.describe()
        return f"Auto(planned_steps={self.planned_steps}, now={now})"


def _differs(a: Choice, b: Choice | None) -> bool:
    return b is None or (a.rule, a.settings) != (b.rule, b.settings)


__all__ = ["Auto", "PlansLength"]
