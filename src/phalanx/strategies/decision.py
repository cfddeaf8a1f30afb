"""Which rule a measured step and link call for: the decision of ``px.Auto``, and of ``phalanx bench``'s projection.

:func:`decide` projects, for AllReduce (float32, or the gradients in 4 bits with error feedback), DiLoCo and
Streaming DiLoCo over a grid of periods, fragments and quantisation, the **time to target** = step time ×
expected steps, where the expected steps are the run's planned length times the rule's measured step penalty
(:mod:`.penalties`, each figure with its source). The fastest wins; within 1% the simpler one does. It is a pure
function of a :class:`Measurement`: :mod:`phalanx.strategies.auto` measures and switches,
:mod:`phalanx.bench.projection` asks it for each link it projects.

Example (the decision on synthetic measurements):
    >>> fast = Measurement(compute_s=0.06, grad_bytes=4e6, rate=1.25e9, overlap=0.5, workers=2)
    >>> decide(fast, planned_steps=200).choice.rule
    'allreduce'
    >>> slow = Measurement(compute_s=0.06, grad_bytes=4e6, rate=1.25e6, overlap=0.0, workers=2)
    >>> decide(slow, planned_steps=5000).choice.rule
    'streaming-diloco'
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from ..errors import ConfigError, usage
from .allreduce import AllReduce
from .base import Strategy
from .diloco import DiLoCo
from .fragments import balanced_split, value_split
from .penalties import ADAPTIVE, INNERS, PENALTIES, PENALTIES_BY_INNER, SGD, Penalty, penalty
from .quantize import Quantize
from .sparseloco import SparseLoCo
from .streaming_diloco import CUTS, StreamingDiLoCo


#: The periods the 2-bit exchange (``quantize=px.SparseLoCo()``) is weighed at: the ones its penalty was measured at
#: (on runs of 180-200 steps, so only below LONG_RUN_ROUNDS outer rounds).
SPARSE_PERIODS = (16,)

#: Below this many outer steps (per fragment) over the run, the outer step is plain averaging (outer_lr 1, no
#: momentum): docs/strategies.md "Short runs" measured it ahead of the Nesterov step at 3-4 outer steps (GPT 124
#: steps against 136; the recurrent LM 180 against 182); the paper's runs, with the Nesterov step, took 100 and more.
#: Where between the two the Nesterov step starts to pay has not been measured.
LONG_RUN_ROUNDS = 20
#: Fewer outer rounds than this over the planned run are not considered (issue 41: a 200-step run with every=64,
#: about 3 rounds per fragment, reached the target on 3/3 seeds; none was measured with fewer).
MIN_ROUNDS = 3
PERIODS = (4, 8, 16, 32, 64, 128, 256, 512)
#: Streaming DiLoCo's periods with a penalty of their own (above); a period between two takes the longer one's, a
#: period above the last takes "streaming-diloco"'s, which no kind of inner optimizer lowers (not measured there).
STREAMING_PERIODS = (4, 8, 16, 32, 64)
#: Up to this period the outer step is plain averaging on any run: the Nesterov step at every=16 needed 1.54x the
#: steps against plain averaging's 1.21x on the GPT (longer periods on long runs take the paper's step).
PLAIN_UP_TO = 16
FRAGMENTS = (2, 4, 8)
BITS: tuple[int | None, ...] = (None, 8, 4)  # the paper found 4-bit outer gradients lose nothing measurable
SPARSE = "sparseloco"  # quantize= in a Choice's settings: px.SparseLoCo() (2-bit top 64 of 4096, error feedback)
#: Assumed when neither ``planned_steps`` nor ``Trainer.fit`` gives the run's length (said in the line).
DEFAULT_PLANNED_STEPS = 10_000
PROBE_BYTES = 2**20  # the link probe: at most 1 MiB (0.8 s at 10 Mbit/s), once per measurement
#: The compressed all-reduce Auto weighs: gradients in 4 bits, blocks of 256, what rounding left out carried to the
#: next step (error feedback), all-gathered as backward fills each bucket (docs/strategies.md "Quantised gradients").
GRAD_BITS, GRAD_BLOCK = 4, 256
#: An exchange's CPU on the cores that train, per worker in the group and per model's worth of values exchanged, in
#: units of the quantising Auto times once (``Measurement.quantize_s``): quantising, adding the others' messages,
#: the outer step. The same for the 4-bit all-reduce (every value every step) and for Streaming DiLoCo (every value
#: once a period), in any bits: ``benchmarks/step_split.py`` measured 2.6-3.5 on the GPT's and 1.8-2.2 on the
#: LSTM's 4-bit all-reduce, 3.0-3.9 on the GPT's streams at 1 Gbit/s (float32 3.0) and 2.6 and 3.2 on the LSTM's
#: at 100 and 10 Mbit/s, all on 2 workers (2026-11-29); 1.5 a worker is 3 on 2. Charging the streams alone, or the
#: all-reduce alone, tipped near-ties to the rule left uncharged (docs/strategies.md).
EXCHANGE_CPU = 1.5


def grad_compressor(bits: int = GRAD_BITS) -> Quantize:
    """The compressed all-reduce's compressor: ``bits``-bit blocks of :data:`GRAD_BLOCK`, with error feedback."""
    return Quantize(bits, block=GRAD_BLOCK, error_feedback=True)


@dataclass(frozen=True)
class Measurement:
    """What the first steps measured (identical on every rank), the inputs of :func:`decide`.

    Args:
        compute_s: one step's time without waiting on the exchange (forward, backward, optimizer, the loop).
        grad_bytes: the gradient's bytes in float32 (4 × trainable parameters).
        rate: the bytes per second the link achieved, in the ring all-reduce model.
        overlap: the share (0-1) of a full gradient all-reduce that backward hid.
        workers: the group's size.
        sizes: each trainable tensor's values, in parameter order: Streaming DiLoCo's fragments hold whole tensors,
            so a model with one dominant tensor (an LSTM's recurrent weights, a language model's embedding) sends
            one fragment far larger than ``1 / fragments`` of it. ``()``: not known, fragments taken as equal.
        quantize_s: one worker's time to quantise the gradient to :data:`GRAD_BITS` bits and back, timed once (the
            exchange of every value adds :data:`EXCHANGE_CPU` x N times it; 0: not measured, taken as free).
        backward_cost_s: what the all-reduce, overlapped with backward, added to the step beyond ``compute_s`` and the
            waiting (hooks, copies, gloo's threads on the cores that train), as the probe measured it where it timed
            a local step too (0: not measured). AllReduce pays it, and so does the compressed all-reduce, which runs
            in the same hooks.
        inner: the inner optimizer's kind, :data:`ADAPTIVE` or :data:`SGD` (:data:`PENALTIES_BY_INNER`); ``""``:
            not one of them, so each rule takes the worst family's penalty.
    """

    compute_s: float
    grad_bytes: float
    rate: float
    overlap: float
    workers: int
    sizes: tuple[int, ...] = ()
    quantize_s: float = 0.0
    backward_cost_s: float = 0.0
    inner: str = ""

    @property
    def tensors(self) -> float:
        """Trainable parameter tensors: the most fragments the model can be cut into (unknown: no limit)."""
        return len(self.sizes) if self.sizes else math.inf

    def fragments(self, parts: int, cut: str = "tensors") -> list[int]:
        """The values in each of Streaming DiLoCo's ``parts`` fragments: its own cut of :attr:`sizes`
        (:func:`balanced_split` of whole tensors, or ``cut="values"``: equal parts), or equal parts where the sizes
        are not known.

        Example:
            >>> m = Measurement(0.1, 4e3, 1e6, 0.0, 2, sizes=(800, 100, 100))
            >>> m.fragments(2), m.fragments(2, cut="values")
            ([800, 200], [500, 500])
        """
        n = round(self.grad_bytes / 4)
        if not self.sizes:
            return [math.ceil(n / parts)] * parts
        if cut == "values":
            return [sum(p.stop - p.start for p in f) for f in value_split(list(self.sizes), parts)]
        return [sum(self.sizes[i] for i in idx) for idx in balanced_split(list(self.sizes), parts)]

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
            bits = kw.get("quantize")
            return AllReduce() if bits is None else AllReduce(compression=grad_compressor(int(bits)))
        if self.rule == "diloco":
            every = kw.pop("every")
            return DiLoCo(every=EveryFrom(every, start), **kw)
        if self.rule == "streaming-diloco":
            if kw.get("quantize") == SPARSE:
                kw["quantize"] = SparseLoCo()
            return StreamingDiLoCo(**kw)  # Auto moves its fragments' offsets to ``start`` after attach
        raise ConfigError(usage(f"auto's rule {self.rule!r}", "plain, allreduce, diloco or streaming-diloco",
                                "The checkpoint was written by another version; resume without it."))

    def describe(self) -> str:
        names = {"plain": "a plain loop", "allreduce": "AllReduce", "diloco": "DiLoCo",
                 "streaming-diloco": "StreamingDiLoCo"}
        if self.rule == "plain":
            return names["plain"]
        if self.rule == "allreduce" and self.settings:
            bits = self.kwargs["quantize"]
            return f"AllReduce(compression=Quantize({bits}, block={GRAD_BLOCK}, error_feedback=True))"
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
        rest = "; ".join(f"{_short(o)} {o.time_s:.1f} s" for o in self.others)
        return (f"phalanx auto: {c.describe()} from step {step}: link {rate_words(m.rate)}, compute "
                f"{m.compute_s * 1e3:.3g} ms/step, {100 * m.overlap:.0f}% of the all-reduce hidden behind backward, "
                f"{m.workers} workers, {_inner_words(m.inner)}, {planned}: projected {c.time_s:.1f} s to target "
                f"({c.step_s * 1e3:.3g} ms/step x {c.steps:.0f} expected steps)" + (f"; {rest}" if rest else ""))


def _inner_words(inner: str) -> str:
    """Whose penalties the projection took, as the line says it."""
    return {ADAPTIVE: "an adaptive inner optimizer's penalties", SGD: "SGD's penalties"}.get(
        inner, "the worst family's penalties (none measured for this inner optimizer, or it is not known)")


def rate_words(rate: float) -> str:
    """A rate in bytes/s in tc's units.

    Example:
        >>> rate_words(1.25e8), rate_words(1.17e7), rate_words(2e9)
        ('1 Gbit/s', '93.6 Mbit/s', '16 Gbit/s')
    """
    mbit = rate * 8 / 1e6
    return f"{mbit / 1e3:.3g} Gbit/s" if mbit >= 1e3 else f"{mbit:.3g} Mbit/s"


def _outer(rounds: float, every: int = 0) -> tuple[tuple[str, Any], ...]:
    """Plain averaging on a short run, or at a period whose penalty was measured with it (Nesterov 0.7/0.9 at
    every=16 needed 1.54x the steps against plain averaging's 1.21x on the GPT); the paper's step otherwise."""
    plain = rounds < LONG_RUN_ROUNDS or every <= PLAIN_UP_TO
    return (("outer_lr", 1.0), ("outer_momentum", 0.0)) if plain else (("outer_lr", 0.7), ("outer_momentum", 0.9))


def candidates(m: Measurement, planned_steps: int) -> list[Choice]:
    """Every setting :func:`decide` weighs, each with its projected step time and expected steps."""
    out = [Choice("allreduce", (), m.compute_s + m.backward_cost_s + (1 - m.overlap) * m.ring_s(m.grad_bytes),
                  planned_steps, "allreduce", m.grad_bytes)]
    n = m.grad_bytes / 4  # parameters
    # The gradients in 4 bits: each worker all-gathers the others' messages while backward runs (what backward hid
    # of the float32 all-reduce it hides of this one), and quantises its own and adds theirs on the CPU it trains on.
    # That CPU is EXCHANGE_CPU x N times one timed quantising, every step.
    message = grad_compressor().message_bytes(math.ceil(n))
    gather = m.gather_s(message)
    exposed = max(0.0, gather - m.overlap * m.ring_s(m.grad_bytes))
    cpu = EXCHANGE_CPU * m.quantize_s * max(m.workers, 2)  # a model's worth of values exchanged
    step = max(m.compute_s + m.backward_cost_s + cpu + exposed, gather)
    out.append(Choice("allreduce", (("quantize", GRAD_BITS),), step,
                      planned_steps * penalty("allreduce-4bit", m.inner).steps, "allreduce-4bit", message))
    for every in PERIODS:
        rounds = planned_steps / every
        if rounds < MIN_ROUNDS:
            continue
        outer = _outer(rounds, every)
        out.append(Choice("diloco", (("every", every), *outer), m.compute_s + (m.ring_s(m.grad_bytes) + cpu) / every,
                          planned_steps * penalty("diloco", m.inner).steps, "diloco", m.grad_bytes / every))
        # every cut (streaming_diloco.CUTS); equal values only where the tensors' cut is uneven (one dominant tensor:
        # its fragment's send is what shows on a slow link)
        for parts, cut in ((p, c) for p in FRAGMENTS for c in CUTS):
            if parts > every or (cut == "tensors" and parts > m.tensors):
                continue
            sizes = m.fragments(parts, cut)
            if cut == "values" and parts <= m.tensors and sizes == m.fragments(parts):  # already even: nothing to weigh
                continue
            # the 2-bit exchange only where its penalty was measured: its period, a short run (plain averaging)
            sparse = every in SPARSE_PERIODS and rounds < LONG_RUN_ROUNDS
            for bits in (*BITS, SPARSE) if sparse else BITS:
                key = "streaming-diloco-sparseloco" if bits == SPARSE else _streaming_penalty(every)
                messages = [4 * per + 4 if bits is None else SparseLoCo().message_bytes(per) if bits == SPARSE
                            else Quantize(bits).message_bytes(per) for per in sizes]
                sends = [m.ring_s(x) if bits is None else m.gather_s(x) for x in messages]
                # each fragment is sent once per period, and one inner step of overlap (tau = 1) hides its send
                # behind compute; the largest fragment's send decides what shows (measured on the LSTM at
                # 10 Mbit/s, one fragment 76% of the model: 147 ms a step where equal fragments projected 108);
                # the link cannot carry more than it carries: the step is at least its share of the link's time
                # and every value's exchange costs the CPU the all-reduce's does, once a period
                exposed = sum(max(0.0, send - m.compute_s) for send in sends)
                step = max(m.compute_s + (exposed + cpu) / every, sum(sends) / every)
                message = sum(messages) / parts
                # SparseLoCo's error feedback takes the outer momentum's place: its outer step is plain averaging
                settings = (("every", every), ("fragments", parts), ("overlap", 1), ("quantize", bits),
                            *(_outer(0) if bits == SPARSE else outer), *((("cut", cut),) if cut != "tensors" else ()))
                out.append(Choice("streaming-diloco", settings, step, planned_steps * penalty(key, m.inner).steps, key,
                                  message * parts / every))
    return out


_SIMPLER = {"allreduce": 0, "diloco": 1, "streaming-diloco": 2}


def _streaming_penalty(every: int) -> str:
    """The penalty of Streaming DiLoCo at ``every``: the shortest measured period at least as long."""
    return next((f"streaming-diloco-h{k}" for k in STREAMING_PERIODS if every <= k), "streaming-diloco")


def _short(c: Choice) -> str:
    return "AllReduce 4-bit" if _family(c) == "allreduce-4bit" else c.describe().split("(")[0]


def _family(c: Choice) -> str:
    """The rule, with the compressed all-reduce told apart (the line names the best of each)."""
    return "allreduce-4bit" if c.rule == "allreduce" and c.settings else c.rule


def decide(m: Measurement, planned_steps: int | None = None) -> Decision:
    """The rule and settings with the shortest projected time to target (step time × expected steps).

    Within 1% of the fastest, the simpler wins (AllReduce, then DiLoCo, then Streaming DiLoCo), then the one
    that sends the fewest bytes (the longest period, the fewest bits: headroom for a slower link; the
    periods the penalties were measured at, 50-64 on 200-step runs, are what a 200-step run gets), then
    the fewest fragments. A group of one: a plain loop.

    Example:
        >>> import dataclasses
        >>> m = Measurement(compute_s=0.06, grad_bytes=4e6, rate=1.25e8, overlap=0.5, workers=2,
        ...                 quantize_s=0.002)  # 1 Gbit/s
        >>> decide(m, 200).choice.describe()
        'AllReduce(compression=Quantize(4, block=256, error_feedback=True))'
        >>> decide(dataclasses.replace(m, rate=1.25e7, overlap=0.0), 200).choice.describe()  # 100 Mbit/s, none hidden
        'StreamingDiLoCo(every=4, fragments=2, overlap=1, quantize=4, outer_lr=1, outer_momentum=0)'
        >>> decide(dataclasses.replace(m, rate=1.25e6), 200).choice.describe()  # 10 Mbit/s
        'StreamingDiLoCo(every=8, fragments=8, overlap=1, quantize=4, outer_lr=1, outer_momentum=0)'
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
    # exact before compressed: a float32 all-reduce within 1% of the 4-bit one keeps the one-process arithmetic
    # whole tensors before cut ones (the paper's fragments: their penalties were measured on them)
    choice = min(close, key=lambda c: (_SIMPLER[c.rule], c.rule == "allreduce" and bool(c.settings),
                                       c.kwargs.get("cut", "tensors") != "tensors", round(c.bytes_per_step),
                                       c.kwargs.get("fragments", 0)))
    others = []
    for key in ("allreduce", "allreduce-4bit", "diloco", "streaming-diloco"):
        top = next((c for c in ranked if _family(c) == key and _family(c) != _family(choice)), None)
        if top is not None:
            others.append(top)
    return Decision(choice, tuple(others), m, planned, known)


__all__ = ["ADAPTIVE", "Choice", "Decision", "EveryFrom", "INNERS", "Measurement", "PENALTIES", "PENALTIES_BY_INNER",
           "Penalty", "SGD", "candidates", "decide", "grad_compressor", "penalty"]
