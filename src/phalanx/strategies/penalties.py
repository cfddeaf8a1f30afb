"""The step penalties ``px.Auto``'s decision rests on: steps to a quality target over one process's steps, per rule
and per kind of inner optimizer, each figure with where it was measured (``python -m benchmarks.levers``).

Data, not code: :mod:`phalanx.strategies.decision` projects each candidate's expected steps as the run's planned
length times :func:`penalty`.

Example:
    >>> penalty("allreduce").steps
    1.0
    >>> penalty("streaming-diloco-h16", ADAPTIVE).steps < penalty("streaming-diloco-h16").steps
    True
"""
from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import Mapping

@dataclass(frozen=True)
class Penalty:
    """Steps to a quality target over one process's steps to it (1.0: no loss per step), and where it was measured."""

    steps: float
    source: str


#: Measured step penalties per rule (steps to target / the one-process run's). Auto's projections rest on these.
#: Auto cannot tell a model family from its measurements, and a choice must hold on every family, so each penalty
#: is the worst family's median where several were measured (benchmarks/reports/quality.md, "Levers"). Where the
#: inner optimizer's kind is known (:attr:`Measurement.inner`), :data:`PENALTIES_BY_INNER` holds its own families'.
PENALTIES: Mapping[str, Penalty] = MappingProxyType({
    "allreduce": Penalty(1.0, "exact gradient averaging: N workers with batch b compute one process's step with "
                              "batch N·b (tests/strategies: the oracle tests), so it needs the one-process steps"),
    "allreduce-4bit": Penalty(1.06, "benchmarks/levers.py, 2 workers, AllReduce(compression=Quantize(4, block=256, "
                                    "error_feedback=True)) at the user's lr, steps to target over the one-process "
                                    "run's: 112, 104, 108 on the GPT (1.00x, 1.00x, 1.08x), 136, 140, 132 on the "
                                    "LSTM (1.06x, 1.00x, 1.10x), 104, 144, 116 on ResNet-20 against DDP's 108, 144, "
                                    "128 (seeds 0-2, 2026-11-29): the worst family's median"),
    "diloco": Penalty(1.92, "DiLoCo(every=50), 2 workers, steps to target over the one-process run's: 1.43x, 1.35x, "
                            "1.36x on the GPT (160, 140, 136 against 112, 104, 100; benchmarks/reports/sparseloco.md), "
                            "1.16x on issue 41's recurrent LM (186 against 160); on ResNet-20 no DiLoCo-family rule "
                            "reached the target in its 200 steps (docs/performance.md section 7), DDP at 104: at "
                            "least 1.92x, the worst family"),
    "streaming-diloco": Penalty(1.92, "periods above 64, taken as 64's: lever-h128 and lever-h160 (benchmarks/"
                                      "levers.py) measured no better than every=64 on any family"),
    "streaming-diloco-h64": Penalty(1.92, "benchmarks/levers.py, 2 workers, steps to target over the one-process "
                                          "run's: StreamingDiLoCo(every=64, fragments=2, overlap=1, quantize=4, "
                                          "outer_lr=1, outer_momentum=0) needed 1.25x, 1.12x, 1.24x on the GPT, "
                                          "1.25x, 1.20x, 1.23x on the LSTM (seeds 0-2) and 1.92x on ResNet-20 (SGD "
                                          "inner; seed 0): the worst family's"),
    # A shorter period, the same rule (2 fragments, tau = 1, 4-bit, plain averaging), seeds 0-2, 2026-11-29; the
    # worst family's median at each (a period between two measured ones takes the longer one's):
    "streaming-diloco-h4": Penalty(1.19, "benchmarks/levers.py, as streaming-diloco with every=4: the GPT 132, 120, "
                                         "120 (1.18x, 1.15x, 1.20x), the LSTM 144, 160, 160 (1.13x, 1.14x, 1.33x), "
                                         "ResNet-20 144, 160, 112 against DDP's 108, 144, 128 (1.33x, 1.11x, 0.88x); "
                                         "with seeds 3-4 (2026-11-30) the LSTM's median 1.19x"),
    "streaming-diloco-h8": Penalty(1.22, "benchmarks/levers.py, as streaming-diloco with every=8: the GPT 132, 120, "
                                         "116 (1.18x, 1.15x, 1.16x), the LSTM 156, 168, 148 (1.22x, 1.20x, 1.23x), "
                                         "ResNet-20 152, 152, 152 against DDP's 108, 144, 128 (1.41x, 1.06x, 1.19x); "
                                         "with 8 fragments cut by values (lever-h8-f8v) the LSTM 152, 160, 156, "
                                         "the GPT 136, 120, 120, ResNet-20 152, 164, 140 (medians 1.19x, 1.20x, "
                                         "1.14x): the cut takes the period's penalty"),
    "streaming-diloco-h16": Penalty(1.33, "benchmarks/levers.py, as streaming-diloco with every=16: the GPT 136, 124, "
                                          "120 (1.21x, 1.19x, 1.20x), the LSTM 152, 164, 148 (1.19x, 1.17x, 1.23x), "
                                          "ResNet-20 164, 192, 152 against DDP's 108, 144, 128 (1.52x, 1.33x, 1.19x; "
                                          "seeds 1-2 on 2026-11-30)"),
    "streaming-diloco-h32": Penalty(1.78, "benchmarks/levers.py, as streaming-diloco with every=32 (2026-11-30): "
                                          "the GPT 140, 128, 120, the LSTM 160, 164, 148 (medians 1.23x, 1.23x), "
                                          "ResNet-20 192, none, 200 against DDP's 108, 144, 128 (1.78x, missed in "
                                          "200 steps: counted as 2x, 1.56x)"),
    "streaming-diloco-sparseloco": Penalty(2.0, "benchmarks/levers.py, as streaming-diloco: every=16 with "
                                                "quantize=px.SparseLoCo() needed 1.14x on the GPT and 1.88x on "
                                                "ResNet-20, and missed the LSTM's target in its 200-step budget (seed "
                                                "0); a family missed counts as 2x"),
})
#: The inner optimizer's kinds the penalties tell apart (:attr:`Measurement.inner`): one that scales each coordinate
#: by a running mean of its squared gradient (Adam, AdamW, RMSprop, ...: the GPT's and the LSTM's AdamW), and SGD
#: with or without momentum (ResNet-20's). Local steps cost them differently: over periods of 4 to 64 the adaptive
#: families lose about the same steps at every period, SGD loses more the longer the period. ``""``: not known.
ADAPTIVE, SGD = "adaptive", "sgd"
INNERS = (ADAPTIVE, SGD)

#: The penalties of one kind of inner optimizer: the worst of its own families' medians (a key not here takes
#: :data:`PENALTIES`', the worst of every family). Seeds 0-4 on the GPT and the LSTM, 0-2 on ResNet-20.
PENALTIES_BY_INNER: Mapping[str, Mapping[str, Penalty]] = MappingProxyType({
    # AdamW on the GPT and the LSTM, seeds 0-4 (benchmarks/levers.py, 2026-11-29 and -30; seeds 3-4 over DDP's
    # steps on loopback, the GPT 104, 88 and the LSTM 136, 128, as seeds 0-2 over the one-process run's): every
    # period from 4 to 64 within 1.16-1.24x, the seeds' spread (1.08-1.33x) wider than the periods'
    ADAPTIVE: MappingProxyType({
        "diloco": Penalty(1.36, "DiLoCo(every=50) on the GPT 1.43x, 1.35x, 1.36x (seeds 0-2; benchmarks/reports/"
                                "sparseloco.md), on issue 41's recurrent LM 1.16x (186 against 160): the GPT's median"),
        "streaming-diloco-h4": Penalty(1.19, "every=4: the GPT 132, 120, 120, 112, 108 (median 1.18x), the LSTM 144, "
                                             "160, 160, 164, 152 (1.19x)"),
        "streaming-diloco-h8": Penalty(1.22, "every=8: the GPT 132, 120, 116, 112, 108 (median 1.16x), the LSTM 156, "
                                             "168, 148, 164, 160 (1.22x)"),
        "streaming-diloco-h16": Penalty(1.21, "every=16: the GPT 136, 124, 120, 112, 104 (median 1.19x), the LSTM "
                                              "152, 164, 148, 164, 160 (1.21x)"),
        "streaming-diloco-h32": Penalty(1.23, "every=32: the GPT 140, 128, 120, 124, 108 (median 1.23x), the LSTM "
                                              "160, 164, 148, 164, 152 (1.21x)"),
        "streaming-diloco-h64": Penalty(1.24, "every=64: the GPT 140, 116, 124, 120, 104 (median 1.18x), the LSTM 160, "
                                          "168, 148, 168, 160 (1.24x)"),
    }),
    # SGD with momentum on ResNet-20, seeds 0-2, over DDP's steps on loopback (108, 144, 128): the longer the period,
    # the more steps
    SGD: MappingProxyType({
        "allreduce-4bit": Penalty(1.0, "AllReduce(compression=Quantize(4, block=256, error_feedback=True)): 104, 144, "
                                       "116 (0.96x, 1.00x, 0.91x); below 1 is the seeds' noise (it cannot beat the "
                                       "exact average it approximates), taken as 1"),
        "streaming-diloco-h4": Penalty(1.11, "every=4: 144, 160, 112 (1.33x, 1.11x, 0.88x)"),
        "streaming-diloco-h8": Penalty(1.19, "every=8: 152, 152, 152 (1.41x, 1.06x, 1.19x)"),
    }),
})


def penalty(key: str, inner: str = "") -> Penalty:
    """The step penalty of ``key`` for this kind of inner optimizer: its own families' where measured, else the
    worst family's.

    Example:
        >>> penalty("streaming-diloco-h16", "adaptive").steps < penalty("streaming-diloco-h16").steps
        True
    """
    return PENALTIES_BY_INNER.get(inner, {}).get(key) or PENALTIES[key]


__all__ = ["ADAPTIVE", "INNERS", "PENALTIES", "PENALTIES_BY_INNER", "Penalty", "SGD", "penalty"]
