"""``px.Auto`` (``strategy="auto"``): measure the step and the link, then pick the rule and its settings.

During its first ``probe_steps`` steps the rule averages gradients (``px.AllReduce``, overlapped with
backward) and measures what :mod:`phalanx.step.clock` already counts: the wall time of a step and the
part of it spent waiting on the exchange (``clock.waited``). Then one timed all-reduce of up to 1 MiB
measures the rate the group's link achieves. From these:

* the compute step ``t_c`` = step − waiting;
* the rate ``B`` from the ring model ``T = 2(N−1)/N · S/B``;
* the overlap: the share of a full gradient all-reduce (``T`` for 4 bytes a parameter) that backward hid.

:func:`decide` then projects, for AllReduce, DiLoCo and Streaming DiLoCo over a grid of periods,
fragments and quantisation, the **time to target** = step time × expected steps, where the expected
steps are the run's planned length times the rule's measured step penalty (:data:`PENALTIES`, each
figure with its source). The fastest wins; within 1% the simpler one does. ``phalanx bench``'s
projection asks the same function (:mod:`phalanx.bench.projection`).

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
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Callable, Mapping, Protocol, TextIO, runtime_checkable

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
from .quantize import Quantize
from .streaming_diloco import StreamingDiLoCo


@dataclass(frozen=True)
class Penalty:
    """Steps to a quality target over one process's steps to it (1.0: no loss per step), and where it was measured."""

    steps: float
    source: str


#: Measured step penalties per rule (steps to target / the one-process run's). Auto's projections rest on these.
PENALTIES: Mapping[str, Penalty] = MappingProxyType({
    "allreduce": Penalty(1.0, "exact gradient averaging: N workers with batch b compute one process's step with "
                              "batch N·b (tests/strategies: the oracle tests), so it needs the one-process steps"),
    "diloco": Penalty(186 / 160, "issue 41's time-to-quality run: recurrent LM (~1M parameters, AdamW, 200-step "
                                 "budget), 2 workers, median of 3 seeds: DiLoCo(every=50) needed 186 steps where one "
                                 "process needs 160"),
    "streaming-diloco": Penalty(180 / 160, "issue 41's second run, the same task: StreamingDiLoCo(every=64, "
                                           "fragments=4, quantize=4) with the outer step the run's length calls for "
                                           "(plain averaging, outer_lr=1, outer_momentum=0, on a short run: "
                                           "LONG_RUN_ROUNDS) needed 180 steps against 160, 3/3 seeds; with the "
                                           "paper's Nesterov step, 182 (docs/performance.md section 7, the GPT: 120 "
                                           "against DDP's 104)"),
})

#: Below this many outer steps (per fragment) over the run, the outer step is plain averaging (outer_lr 1, no
#: momentum): docs/strategies.md "Short runs" measured it ahead of the Nesterov step at 3-4 outer steps (GPT 124
#: steps against 136; the recurrent LM 180 against 182); the paper's runs, with the Nesterov step, took 100 and more.
#: Where between the two the Nesterov step starts to pay has not been measured.
LONG_RUN_ROUNDS = 20
#: Fewer outer rounds than this over the planned run are not considered (issue 41: a 200-step run with every=64,
#: about 3 rounds per fragment, reached the target on 3/3 seeds; none was measured with fewer).
MIN_ROUNDS = 3
PERIODS = (8, 16, 32, 64, 128, 256, 512)
FRAGMENTS = (2, 4, 8)
BITS: tuple[int | None, ...] = (None, 8, 4)  # the paper found 4-bit outer gradients lose nothing measurable
#: Assumed when neither ``planned_steps`` nor ``Trainer.fit`` gives the run's length (said in the line).
DEFAULT_PLANNED_STEPS = 10_000
PROBE_BYTES = 2**20  # the link probe: at most 1 MiB (0.8 s at 10 Mbit/s), once per measurement


@dataclass(frozen=True)
class Measurement:
    """What the first steps measured (identical on every rank), the inputs of :func:`decide`.

    Args:
        compute_s: one step's time without waiting on the exchange (forward, backward, optimizer, the loop).
        grad_bytes: the gradient's bytes in float32 (4 × trainable parameters).
        rate: the bytes per second the link achieved, in the ring all-reduce model.
        overlap: the share (0-1) of a full gradient all-reduce that backward hid.
        workers: the group's size.
        tensors: trainable parameter tensors (a fragment holds whole tensors).
    """

    compute_s: float
    grad_bytes: float
    rate: float
    overlap: float
    workers: int
    tensors: int = 1 << 30

    def ring_s(self, nbytes: float) -> float:
        """A ring all-reduce of ``nbytes`` on this link: 2(N-1)/N · S/B."""
        n = self.workers
        return 0.0 if n <= 1 else 2 * (n - 1) / n * nbytes / self.rate

    def gather_s(self, nbytes: float) -> float:
        """An all-gather of ``nbytes`` from each worker (the quantised exchange): (N-1) · S/B."""
        return max(self.workers - 1, 0) * nbytes / self.rate


@dataclass(frozen=True)
class Choice:
    """A rule with its settings, and what :func:`decide` projected for it."""

    rule: str  # "plain", "allreduce", "diloco" or "streaming-diloco"
    settings: tuple[tuple[str, Any], ...] = ()
    step_s: float = 0.0
    steps: float = 0.0  # expected steps to target
    penalty: str = ""
    bytes_per_step: float = 0.0  # what one worker sends per step, averaged over a period

    @property
    def time_s(self) -> float:
        return self.step_s * self.steps

    @property
    def kwargs(self) -> dict[str, Any]:
        return dict(self.settings)

    def build(self, start: int = 0) -> Strategy | None:
        """The rule, its periodic schedule counted from ``start`` (the step it takes over at)."""
        kw = self.kwargs
        if self.rule == "plain":
            return None
        if self.rule == "allreduce":
            return AllReduce()
        if self.rule == "diloco":
            every = kw.pop("every")
            return DiLoCo(every=EveryFrom(every, start), **kw)
        if self.rule == "streaming-diloco":
            return StreamingDiLoCo(**kw)  # Auto moves its fragments' offsets to ``start`` after attach
        raise ConfigError(usage(f"auto's rule {self.rule!r}", "plain, allreduce, diloco or streaming-diloco",
                                "The checkpoint was written by another version; resume without it."))

    def describe(self) -> str:
        names = {"plain": "a plain loop", "allreduce": "AllReduce", "diloco": "DiLoCo",
                 "streaming-diloco": "StreamingDiLoCo"}
        if self.rule == "plain":
            return names["plain"]
        args = ", ".join(f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}" for k, v in self.settings)
        return f"{names[self.rule]}({args})"

    def state(self) -> dict[str, Any]:
        return {"rule": self.rule, "settings": [list(kv) for kv in self.settings], "step_s": self.step_s,
                "steps": self.steps}

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> "Choice":
        return cls(str(state["rule"]), tuple((str(k), v) for k, v in state["settings"]), float(state["step_s"]),
                   float(state["steps"]))


@dataclass(frozen=True)
class EveryFrom:
    """Sync every ``k`` steps counted from ``start``: a DiLoCo that takes over at step ``start``.

    Example:
        >>> [s for s in range(1, 12) if EveryFrom(4, 3)(s)]
        [7, 11]
    """

    k: int
    start: int

    def __call__(self, step: int) -> bool:
        return step > self.start and (step - self.start) % self.k == 0

    def __repr__(self) -> str:
        return f"every({self.k}) from step {self.start}"


@dataclass(frozen=True)
class Decision:
    """The fastest :class:`Choice` and the best of each other rule, by projected time to target."""

    choice: Choice
    others: tuple[Choice, ...]
    measurement: Measurement
    planned_steps: int
    planned_known: bool = True

    def line(self, step: int) -> str:
        """The one line Auto prints: what it chose and why."""
        m = self.measurement
        planned = f"{self.planned_steps} planned steps" if self.planned_known else \
            f"{self.planned_steps} steps assumed (pass px.Auto(planned_steps=N))"
        c = self.choice
        rest = "; ".join(f"{o.describe().split('(')[0]} {o.time_s:.1f} s" for o in self.others)
        return (f"phalanx auto: {c.describe()} from step {step}: link {rate_words(m.rate)}, compute "
                f"{m.compute_s * 1e3:.3g} ms/step, {100 * m.overlap:.0f}% of the all-reduce hidden behind backward, "
                f"{m.workers} workers, {planned}: projected {c.time_s:.1f} s to target ({c.step_s * 1e3:.3g} ms/step "
                f"x {c.steps:.0f} expected steps)" + (f"; {rest}" if rest else ""))


def rate_words(rate: float) -> str:
    """A rate in bytes/s in tc's units.

    Example:
        >>> rate_words(1.25e8), rate_words(1.17e7), rate_words(2e9)
        ('1 Gbit/s', '93.6 Mbit/s', '16 Gbit/s')
    """
    mbit = rate * 8 / 1e6
    return f"{mbit / 1e3:.3g} Gbit/s" if mbit >= 1e3 else f"{mbit:.3g} Mbit/s"


def _outer(rounds: float) -> tuple[tuple[str, Any], ...]:
    return (("outer_lr", 1.0), ("outer_momentum", 0.0)) if rounds < LONG_RUN_ROUNDS else \
        (("outer_lr", 0.7), ("outer_momentum", 0.9))


def candidates(m: Measurement, planned_steps: int) -> list[Choice]:
    """Every setting :func:`decide` weighs, each with its projected step time and expected steps."""
    out = [Choice("allreduce", (), m.compute_s + (1 - m.overlap) * m.ring_s(m.grad_bytes), planned_steps,
                  "allreduce", m.grad_bytes)]
    n = m.grad_bytes / 4  # parameters
    for every in PERIODS:
        rounds = planned_steps / every
        if rounds < MIN_ROUNDS:
            continue
        outer = _outer(rounds)
        out.append(Choice("diloco", (("every", every), *outer), m.compute_s + m.ring_s(m.grad_bytes) / every,
                          planned_steps * PENALTIES["diloco"].steps, "diloco", m.grad_bytes / every))
        key = "streaming-diloco"
        for parts in FRAGMENTS:
            if parts > m.tensors or parts > every:
                continue
            for bits in BITS:
                per = n / parts
                message = 4 * per + 4 if bits is None else Quantize(bits).message_bytes(math.ceil(per))
                send = m.ring_s(message) if bits is None else m.gather_s(message)
                # one inner step of overlap (tau = 1) hides a send behind compute; parts/every sends per step, and
                # the link cannot carry more than it carries: the step is at least its share of the link's time
                exposed = max(0.0, send - m.compute_s)
                step = max(m.compute_s + parts / every * exposed, parts / every * send)
                settings = (("every", every), ("fragments", parts), ("overlap", 1), ("quantize", bits), *outer)
                out.append(Choice("streaming-diloco", settings, step, planned_steps * PENALTIES[key].steps, key,
                                  message * parts / every))
    return out


_SIMPLER = {"allreduce": 0, "diloco": 1, "streaming-diloco": 2}


def decide(m: Measurement, planned_steps: int | None = None) -> Decision:
    """The rule and settings with the shortest projected time to target (step time × expected steps).

    Within 1% of the fastest, the simpler wins (AllReduce, then DiLoCo, then Streaming DiLoCo), then the one
    that sends the fewest bytes (the longest period, the fewest bits: headroom for a slower link; the
    periods the penalties were measured at, 50-64 on 200-step runs, are what a 200-step run gets), then
    the fewest fragments. A group of one: a plain loop.

    Example:
        >>> m = Measurement(compute_s=0.06, grad_bytes=4e6, rate=1.25e7, overlap=0.0, workers=2)
        >>> decide(m, 200).choice.describe()
        'StreamingDiLoCo(every=64, fragments=2, overlap=1, quantize=4, outer_lr=1, outer_momentum=0)'
        >>> decide(dataclasses.replace(m, workers=1), 200).choice.rule
        'plain'
    """
    known = planned_steps is not None
    planned = int(planned_steps) if known else DEFAULT_PLANNED_STEPS
    if m.workers <= 1:
        return Decision(Choice("plain", (), m.compute_s, planned), (), m, planned, known)
    ranked = sorted(candidates(m, planned), key=lambda c: c.time_s)
    best = ranked[0].time_s
    close = [c for c in ranked if c.time_s <= best * 1.01]
    choice = min(close, key=lambda c: (_SIMPLER[c.rule], round(c.bytes_per_step), c.kwargs.get("fragments", 0)))
    others = []
    for rule in ("allreduce", "diloco", "streaming-diloco"):
        top = next((c for c in ranked if c.rule == rule and c.rule != choice.rule), None)
        if top is not None:
            others.append(top)
    return Decision(choice, tuple(others), m, planned, known)


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


__all__ = ["Auto", "Choice", "Decision", "EveryFrom", "Measurement", "PENALTIES", "Penalty", "PlansLength",
           "candidates", "decide"]
