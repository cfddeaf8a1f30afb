"""``phalanx bench``: throughput, speedup, efficiency, where the step time goes, and a projection.

* :mod:`.cli`: the command (``phalanx bench --help``);
* :mod:`.spec`: setups and the list of runs; :mod:`.runner`: real worker processes;
  :mod:`.worker` and :mod:`.tta`: what each process does;
* :mod:`.stats`, :mod:`.report`, :mod:`.plots`, :mod:`.targets`, :mod:`.projection`: numbers to tables and PNGs;
* :mod:`.breakdown`: the step-time probe, also a :class:`phalanx.Trainer` callback (:class:`StepBreakdown`);
* :mod:`.netns`: the rate-limited link (network namespaces, veth, tc tbf).
"""
from .breakdown import StepBreakdown, StepProbe

__all__ = ["StepBreakdown", "StepProbe"]
