"""``px.Auto`` (``strategy="auto"``): measure the step and the link, then pick the rule and its settings.

It measures the link first, with one timed all-reduce of up to 1 MiB at attach (the rate ``B`` from
the ring model ``T = 2(N−1)/N · S/B``). Step 1 is a local step (no exchange; it is the warm-up, and it
times the step). Then the probe takes one of two paths:

* **a fast link** (a full gradient's all-reduce ``T(4 bytes a parameter)`` within ``slow_link`` (1) times
  step 1): step 2 is local too, and timed: the compute step ``t_c`` (with ``probe_steps`` >= 3). Then the
  replicas take one full average (parameters and optimizer state: a commit point) and the remaining probe
  steps average gradients (``px.AllReduce``, overlapped with backward); Auto measures what
  :mod:`phalanx.step.clock` counts: the step's wall time and the part spent waiting on the exchange
  (``clock.waited``); the overlap is the share of ``T`` that backward hid, and AllReduce's step beyond ``t_c``
  and the waiting is what the overlapped all-reduce costs backward on the cores that train
  (``Measurement.backward_cost_s``), which only the all-reduces pay (``probe_steps=2``: ``t_c`` = AllReduce's
  step − waiting, as there is no local step to time);
* **a slow link** (``T`` more than ``slow_link`` times step 1): an all-reduce step would cost more than
  a compute step, so the remaining probe steps stay local, as the first steps of a periodic rule (nothing
  sent per step): ``t_c`` is their mean step, and the overlap is taken as 0 (backward can hide at most
  ``t_c`` of ``T``, so an AllReduce step takes ``T`` or more, beyond the 1.18x margin of the streamed
  rule's penalty). The fast path's own cost is why the line is at 1: its first average moves the parameters
  and the optimizer state (3 copies of the model for Adam, then AllReduce's attach), and its steps a full
  all-reduce each; the GPT of ``benchmarks/quality`` on 100 Mbit/s (``T`` 3-4 times its step) spent 1.5 s
  in its 3 probe steps against 0.16 s of compute (``phalanx run -n 2 --link 100mbit``), 12% of a 200-step
  run, when the threshold was 4. A periodic rule chosen there (DiLoCo, Streaming DiLoCo) takes the probe's local
  steps as its own first inner steps, its anchors the parameters at attach (identical on every rank): no average
  ends the probe. For AllReduce it ends with one full average of the parameters and of the optimizer state, so
  every rank steps one model: the same commit-point rule Auto uses when it switches. What that average
  sends is each replica's drift since attach (the replicas were identical there) in 4 bits, as Streaming
  DiLoCo's outer exchange does: every rank adds the same mean to the same origin, so the replicas are again
  identical to the bit, for about an eighth of the float32 parameters' bytes on two workers (the float32
  average where it would send less: 15 workers or more). The probe then costs that average and the 1 MiB
  link probe instead of ``probe_steps`` full all-reduces.

:func:`phalanx.strategies.decision.decide` then picks the rule and its settings by projected time to target
(step time × the planned steps × the rule's measured step penalty); ``phalanx bench``'s projection asks the
same function (:mod:`phalanx.bench.projection`).

It decides again after every regroup (``phalanx.elastic``) and when the rate, measured again every
``recheck_every`` steps, has changed by more than 2×. It changes rule only at a commit point where
both rules' state is defined: right after a full average (every step of AllReduce, a DiLoCo round, or
a full average of every Streaming DiLoCo fragment that it takes for the purpose). Each choice is
printed as one line on rank 0 and kept in :meth:`Auto.state_dict` (the schedule so far, the
measurement, the probe's path, the rule's own state), so a resume or a joiner follows the same schedule
rather than measuring again.

Example (the decision itself, on synthetic measurements, is :mod:`phalanx.strategies.decision`'s):
    >>> import phalanx as px
    >>> type(px.Auto()).__name__
    'Auto'
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
from .base import Start, StepState, Strategy, from_rank_0, parameters_as_they_are
from .diloco import DiLoCo
from .streaming_diloco import StreamingDiLoCo
from . import probe
from .decision import Choice, Decision, Measurement, decide

#: The rules that take a local probe's steps as their own first inner steps, with no average (_end_local_probe).
PERIODIC = ("diloco", "streaming-diloco")


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
        probe_steps: steps measured before the first decision (the first, local, is a warm-up), >= 2: with
            AllReduce on a fast link, local on a slow one (module docstring).
        recheck_every: steps between two measurements of the link's rate (one small timed all-reduce).
        decider: the decision function (:func:`decide`); tests pass their own.
        out: where rank 0 prints its line (stderr).

    Example:
        >>> import torch, phalanx as px
        >>> net = torch.nn.Linear(4, 2)
        >>> model, opt = px.wrap(net, torch.optim.SGD(net.parameters(), lr=0.1), strategy=px.Auto(planned_steps=200))
    """

    name = "auto"
    #: A link is slow when a full gradient's all-reduce takes more than this many times step 1 (a local step):
    #: the probe then takes its steps locally and ends with one parameter average (module docstring).
    slow_link = 1.0

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
        self.link_rate: float | None = None  # the rate the first link probe measured (attach), agreed everywhere
        # the probe's path: None (step 1, local), "local", "timing" (a fast link's step 2, local) or "allreduce"
        self.probing: str | None = None
        self._local_s: float | None = None  # a fast link's step 2, timed with nothing sent (agreed)
        self._t0 = 0.0  # when attach ended: step 1's time is counted from there
        self._drifted = False  # the local probe's replicas were averaged, their optimizer states not yet
        self._origin: list[torch.Tensor] | None = None  # the parameters at attach, while a local probe may need them
        self._regrouped = False
        self._decision: Decision | None = None  # the decision of the pending choice
        self._from_origin: list[torch.Tensor] | None = None  # a periodic rule's anchors after a local probe (_use)

    # -- the template ------------------------------------------------------------------------------------------
    def attach(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> nn.Module:
        module = super().attach(model, optimizer)
        if self.comm.world_size == 1 and not rebuilt(group.current()):
            self.choice = Choice("plain")
            self._say("phalanx auto: a group of one trains as a plain loop (nobody to exchange with); "
                      "nothing is measured")
            return module
        # the link first (one bounded all-reduce), so that a slow one is known before any gradient crosses it;
        # alone (an elastic group of one) nothing crosses a link: the rate is taken as infinite until peers join
        self.link_rate = self._agreed_rate() if self.comm.world_size > 1 else math.inf
        if self.comm.world_size > 1 and all(type(p.data) is torch.Tensor and p.is_floating_point()
                                            for p in self.params):  # (a sharded model's DTensors average whole)
            self._origin = [p.detach().clone() for p in self.params]  # identical on every rank: wrap broadcast them
        self._t0 = time.perf_counter()
        return module

    def weighs_gradients(self, step: int) -> bool:
        return self.rule is not None and weighs_gradients(self.rule, step)

    def replicas_agree(self, step: int) -> bool:
        if self.rule is None:  # the probe's local steps drift apart until its average; a plain loop is alone
            return self.choice is not None
        return replicas_agree(self.rule, step)

    def after_backward(self, step: int) -> None:
        if self.rule is not None:
            self.rule.after_backward(step)

    def after_step(self, step: int, taken: bool) -> None:
        if self.rule is not None:
            self.rule.after_step(step, taken)
        if self.choice is None:  # measuring
            work = 0.0
            if self.probing in (None, "timing"):
                start = time.perf_counter()
                self._take_path(step)
                # the clock counts this whole call as waiting once it returns, after the sample below: the path's
                # own work (an average, AllReduce's attach) is neither the window's compute nor its waiting
                work = time.perf_counter() - start
            self._probe.append((time.perf_counter(), self.clock.waited + work))
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
        elif self.choice is None and self.probing in ("local", "timing"):  # ended inside local probe steps: one model
            self._end_local_probe()

    # -- measuring and deciding --------------------------------------------------------------------------------
    def _take_path(self, step: int) -> None:
        """After step 1 (local): on a slow link stay local; on a fast one time step 2 locally too (``probe_steps``
        >= 3), then average (a commit point) and take AllReduce for the rest of the probe."""
        now = time.perf_counter()
        if self.probing == "timing":  # step 2, local and warm: the compute step, with no exchange beside it
            # (loaded inside the probe, or a joiner: no step 1 here; from attach, and every rank takes this branch)
            (self._local_s,) = probe.agreed(self.comm, [now - (self._probe[-1][0] if self._probe else self._t0)])
        else:
            vals = probe.agreed(self.comm, [now - self._t0])
            m = probe.measurement(self.params, self.comm.world_size, compute_s=vals[0],
                                  rate=self.link_rate or math.inf)
            if m.ring_s(m.grad_bytes) > self.slow_link * vals[0]:
                self.probing = "local"
                return
            if self.probe_steps >= 3:
                self.probing = "timing"
                return
        self.probing, self._origin = "allreduce", None
        probe.average_parameters(self.comm, self.params, self.model)
        self._average_optimizer_state()
        self._use(Choice("allreduce"), step)

    def _end_local_probe(self, choice: Choice | None = None) -> None:
        """The local probe's one full average: every replica the mean (the chosen rule's attach starts there).

        The drift since attach crosses the link in 4 bits (module docstring), unless the float32 average sends
        less (many workers: an all-gather grows with them) or there is no origin to add it to (a resume or a
        regroup inside the probe, a sharded model).

        A periodic rule (``choice`` DiLoCo or Streaming DiLoCo) with the origin known needs no average: it takes
        the probe's local steps as its own first inner steps, its anchors the origin (identical on every rank), and
        its first outer step sends what the average would have (:meth:`_use`). On 10 Mbit/s the average was the
        probe's dearest part: 0.75 s of the LSTM's step 3 (``benchmarks/step_split.py lstm auto``).
        """
        if choice is not None and choice.rule in PERIODIC and self._origin is not None:
            self._from_origin, self._origin = self._origin, None
            return
        origin, self._origin = self._origin, None
        probe.average_drift(self.comm, self.params, self.model, origin)
        self._drifted = True  # AllReduce, if chosen, needs one optimizer state too (_use)

    def _measure(self) -> Measurement:
        """The probe window's measurement (:func:`.probe.window_measurement`), at the rate the link probe measured."""
        window, self._probe = self._probe, []
        return probe.window_measurement(self.comm, self.params, window, local=self.probing == "local",
                                        local_s=self._local_s,
                                        rate=self.link_rate if self.link_rate is not None else math.inf,
                                        inner=probe.inner_kind(self.optimizer))

    def _agreed_rate(self) -> float:
        """One probe of the link, its time agreed on every rank: the rate in the ring model."""
        return probe.ring_rate(self.comm, *self._probe_link())

    def _probe_link(self) -> tuple[int, float]:
        """One timed all-reduce of up to 1 MiB (:func:`.probe.probe_link`); tests inject a link's rate here."""
        return probe.probe_link(self.comm, self.params)

    def _decide(self, step: int, *, initial: bool = False) -> None:
        assert self.measurement is not None
        decision = self.decider(self.measurement, self.planned_steps)
        if initial:
            line = decision.line(step)
            if self.probing == "local":  # the line says why the probe sent no gradient
                self._end_local_probe(decision.choice)
                m = self.measurement
                ended = " (its first inner steps)" if self._from_origin is not None else " and one average"
                line += (f"; probed with {self.probe_steps} local steps{ended} (a full all-reduce "
                         f"{m.ring_s(m.grad_bytes):.3g} s against {m.compute_s * 1e3:.3g} ms of compute)")
            self._switch(decision.choice, step, line)
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
        return self._agreed_rate()

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

    def _use(self, choice: Choice, start: int, *, replicas: Start = parameters_as_they_are) -> None:
        """Put ``choice``'s rule in charge from step ``start``: the old one's hooks come off, the new one attaches
        (collective: the same step on every rank) and shares this rule's comm and clock."""
        old = self.rule
        overlap = getattr(old, "_overlap", None)
        if overlap is not None:
            overlap.remove()
        rule = choice.build(start)
        # read before it is cleared: the local probe's replicas hold their own optimizer states until averaged
        drifted, self._drifted = self._drifted, False
        origin, self._from_origin = self._from_origin, None
        self.rule, self.start, self.running = rule, start, choice
        if rule is None:
            return
        rule.comm, rule.clock = self.comm, self.clock  # one byte count, one step count
        if isinstance(rule, AllReduce):
            if drifted or (old is not None and not isinstance(old, AllReduce)):
                self._average_optimizer_state()
            rule.attach(self.model, self.optimizer, wrapper=False)  # no DDP module: the user's module stays
        elif origin is not None:
            # After a local probe: the anchors are the origin (every rank's parameters at attach), the replicas go on
            # from where their local steps took them, as if the rule had been in charge since attach
            with torch.no_grad():
                drifted_params = [p.detach().clone() for p in self.params]
                for p, o in zip(self.params, origin, strict=True):
                    p.copy_(o)
                rule.attach(self.model, self.optimizer, start=parameters_as_they_are)
                for p, d in zip(self.params, drifted_params, strict=True):
                    p.copy_(d)
        else:
            # Taking over at a commit point (a full average: the replicas are one) the parameters need not travel
            # again; a periodic rule's own syncs would reconcile them anyway. AllReduce keeps rank 0's broadcast: it
            # never reconciles parameters, so a difference of one bit would stay. A resume (load_state_dict) too.
            rule.attach(self.model, self.optimizer, start=replicas)
        if isinstance(rule, StreamingDiLoCo):
            for f in rule.fragments:
                f.offset = (start + f.offset) % rule.every
                f.synced_at = 0 if origin is not None else start  # the replicas last held the anchors at attach

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
        self._origin = None  # a joiner's origin is not the others': a probe still running averages in float32
        self._regrouped = self.measurement is not None  # a group of one from the start measured nothing: stays plain

    # -- state ------------------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The schedule so far, the current choice and since when, the measurement, and the rule's own state."""
        m = self.measurement
        return {"choice": None if self.choice is None else self.choice.state(), "start": self.start,
                "schedule": [dict(s) for s in self.schedule], "checked": self.checked,
                "measurement": None if m is None else dataclasses.asdict(m),
                "pending": None if self.pending is None else self.pending.state(),
                "probing": self.probing, "link_rate": self.link_rate,
                "rule": self.rule.state_dict() if self.rule is not None else {}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Follow the saved schedule: the saved rule, from the step it took over at (its attach is collective where
        every rank loads, as on a resume; a joiner entering alone attaches alone)."""
        choice = None if state["choice"] is None else Choice.from_state(state["choice"])
        start = int(state["start"])
        if choice is not None and (_differs(choice, self.running) or start != self.start):
            self._use(choice, start, replicas=from_rank_0)  # not taken over at a commit point: loaded
        self.choice, self.start, self.checked = choice, start, int(state["checked"])
        self.schedule = [dict(s) for s in state["schedule"]]
        self.measurement = None if state["measurement"] is None else probe.saved_measurement(self.params,
                                                                                              state["measurement"])
        self.pending = None if state["pending"] is None else Choice.from_state(state["pending"])
        self._probe = []
        self._origin = None  # the loaded parameters are not the origin: a probe still running averages in float32
        self.probing, self.link_rate = state.get("probing"), state.get("link_rate", self.link_rate)
        if choice is None and self.probing == "allreduce" and self.rule is None:  # saved inside the AllReduce probe
            self._use(Choice("allreduce"), start, replicas=from_rank_0)
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
