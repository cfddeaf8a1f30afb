"""The apps: ``phalanx bench`` (throughput, speedup, efficiency, where the step time goes, a projection) and
``phalanx demo``. Installed with the extra ``pip install 'phalanx[bench]'`` (scikit-learn, matplotlib); nothing
in the rest of the package imports this subpackage.

* :mod:`.demo`, :mod:`.keras_demo`, :mod:`.stream_demo` (+ :mod:`.stream_demo_worker`), :mod:`.demo_table`:
  ``phalanx demo`` and its ``--keras`` and ``--stream`` forms;
* :mod:`.models`: the reference models (the zoo) and scikit-learn's digits; :mod:`.procs`: start N real
  worker processes; :mod:`.placement`: parameter-server placement on the reference models;
* :mod:`.cli`: the command (``phalanx bench --help``);
* :mod:`.spec`: setups and the list of runs; :mod:`.runner`: real worker processes;
  :mod:`.worker` and :mod:`.tta`: what each process does;
* :mod:`.stats`, :mod:`.report`, :mod:`.plots`, :mod:`.projection`: numbers to tables and PNGs;
* :mod:`.breakdown`: the step-time probe, also a :class:`phalanx.Trainer` callback (:class:`StepBreakdown`);
* the rate-limited link (network namespaces, veth, tc tbf) is :mod:`phalanx.launch.netns`, which `phalanx run
  --link` uses too.
"""
from .breakdown import StepBreakdown, StepProbe

__all__ = ["StepBreakdown", "StepProbe"]
