"""``/metrics``: the status page's numbers in Prometheus's text format (version 0.0.4).

Names follow Prometheus's conventions (``phalanx_`` prefix, base units: seconds, bytes),
one gauge per figure, each worker's labelled by ``worker`` (its id), ``rank`` and
``generation``. The straggler is ``phalanx_worker_straggler`` 1 on its row, with a
``cause`` label (compute, input, exchange) and ``phalanx_worker_straggler_ratio``.

Example:
    >>> text = render({"generation": 2, "members": ["0"], "workers": [{"worker": "0", "rank": 0, "step": 9,
    ...     "step_s": 0.01, "straggler": None}], "straggler": None, "throughput": [], "ended": None,
    ...     "changes": [], "checkpoint": None})
    >>> [line for line in text.splitlines() if line.startswith("phalanx_worker_step{")]
    ['phalanx_worker_step{worker="0",rank="0",generation="2"} 9']
"""
from __future__ import annotations

from typing import Any

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# (name, summary field, help)
WORKER = (("phalanx_worker_step", "step", "Steps this worker has closed (rolls back with an elastic rollback)."),
          ("phalanx_worker_step_seconds", "step_s", "Median step time over the last 50 steps."),
          ("phalanx_worker_compute_seconds", "compute_s", "Median time per step in compute (the step less input and "
                                                          "exchange)."),
          ("phalanx_worker_input_seconds", "input_s", "Median time per step waiting for the loader's batch."),
          ("phalanx_worker_exchange_seconds", "exchange_s", "Median time per step in the exchange (waiting for "
                                                            "peers included)."),
          ("phalanx_worker_samples_per_second", "samples_per_s", "This worker's samples per second."),
          ("phalanx_worker_sent_bytes_per_step", "bytes_per_step", "Payload bytes this worker sends per step."),
          ("phalanx_worker_batch_share", "share", "This worker's share of the global batch (balance='speed')."),
          ("phalanx_worker_heartbeat_age_seconds", "heartbeat_age_s", "Seconds since this worker's last report."))


def _escape(value: object) -> str:
    return str(value).replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _labels(**labels: object) -> str:
    return "{" + ",".join(f'{k}="{_escape(v)}"' for k, v in labels.items()) + "}"


def _number(v: float) -> str:
    return repr(float(v)) if isinstance(v, float) else str(v)


def render(status: dict[str, Any]) -> str:
    """The Prometheus text of ``status`` (:meth:`phalanx.monitor.collect.Collector.status`)."""
    out: list[str] = []

    def gauge(name: str, help_: str, rows: list[tuple[str, Any]]) -> None:
        rows = [(labels, v) for labels, v in rows if isinstance(v, (int, float)) and not isinstance(v, bool)]
        out.extend([f"# HELP {name} {help_}", f"# TYPE {name} gauge"])
        out.extend(f"{name}{labels} {_number(v)}" for labels, v in rows)

    g = status["generation"]
    gauge("phalanx_generation", "The group's generation (bumped by every membership change).", [("", g)])
    gauge("phalanx_workers", "Workers in the current generation.", [("", len(status["members"]))])
    gauge("phalanx_membership_changes", "Membership changes the workers noted so far.", [("", len(status["changes"]))])
    rates = status["throughput"]
    gauge("phalanx_samples_per_second", "The job's samples per second (all workers).",
          [("", rates[-1][1])] if rates else [])
    ckpt = status.get("checkpoint") or {}
    gauge("phalanx_checkpoint_age_seconds", "Age of the newest checkpoint px.save_checkpoint wrote in this job.",
          [("", ckpt.get("age_s"))])
    gauge("phalanx_job_ended", "1 once the job has ended (phalanx_job_exit_code says how).",
          [("", 1 if status["ended"] else 0)])
    if status["ended"]:
        gauge("phalanx_job_exit_code", "The launcher's exit status.", [("", status["ended"]["code"])])
    workers = status["workers"]
    labels = {w["worker"]: _labels(worker=w["worker"], rank=w["rank"], generation=g) for w in workers}
    for name, field, help_ in WORKER:
        gauge(name, help_, [(labels[w["worker"]], w.get(field)) for w in workers])
    s = status["straggler"]
    gauge("phalanx_worker_straggler", "1 on the worker that holds the others back (label cause: compute, input or "
          "exchange).", [(_labels(worker=w["worker"], rank=w["rank"], generation=g,
                                  **({"cause": s["cause"]} if s and s["worker"] == w["worker"] else {})),
                          1 if s and s["worker"] == w["worker"] else 0) for w in workers])
    gauge("phalanx_worker_straggler_ratio", "The straggler's part over the median of the others' same part.",
          [(_labels(worker=s["worker"], rank=s["rank"], generation=g, cause=s["cause"]), s["ratio"])] if s else [])
    return "\n".join(out) + "\n"


__all__ = ["CONTENT_TYPE", "render"]
