"""See inside a running job: the status page, ``/status.json`` and ``/metrics`` the launcher serves.

``phalanx run --status [HOST:]PORT`` (loopback unless a host is given) starts the workers
with their reporters on (:mod:`phalanx.step.telemetry`: each step's time split into compute,
input and exchange, summarised once a second into the job's store) and serves, from the
launcher that holds the store:

- ``/``: one HTML page, no script from elsewhere, that updates itself every second: the
  generation, each worker's figures, the straggler and why, the membership changes and
  what they cost, the newest checkpoint, the throughput over time, and, when the job
  ends, how it ended;
- ``/status.json``: the same, for scripts;
- ``/metrics``: the same numbers in Prometheus's text format.

Only the holder of the job's status token, derived from the job's secret, gets an answer
(:mod:`phalanx.monitor.server`). :mod:`phalanx.monitor.collect` reads the workers'
summaries, :mod:`phalanx.monitor.straggler` names the rank that holds the others back.

Example:
    >>> from phalanx.monitor import Collector, StatusServer, attribute, token  # noqa: F401
"""
from __future__ import annotations

from .collect import Collector
from .server import StatusServer, parse_address, token
from .straggler import attribute

__all__ = ["Collector", "StatusServer", "attribute", "parse_address", "token"]
