"""PROJECTION, not measurement: efficiency at more workers on faster links, from measured inputs.

For each model and setup the inputs are measured on this machine: the compute
time of one step on one worker, t_c (the 1-worker step time), and the bytes the
setup puts into collectives per step, S, and its number of collectives per step, c
(for DDP-based setups, the number of gradient buckets). A ring all-reduce of S
bytes among N workers with bandwidth B and per-message latency α takes

    T(N) = 2(N−1)/N · S/B + 2(N−1)·α·c

(a parameter server sharded over all N workers moves the same bytes, as BytePS
notes). The projection assumes **no overlap** of communication with compute, so
efficiency E(N) = t_c / (t_c + T(N)) is a lower bound for DDP-style overlap, and the
projected throughput is N·batch / (t_c + T(N)). It says nothing about convergence:
local SGD and compression take more steps to a given accuracy than exact
all-reduce, which the time-to-accuracy measurement shows.

Example:
    >>> round(ring_seconds(n=2, nbytes=1e6, bandwidth=1e9 / 8, alpha=0.0), 4)
    0.008
"""
from __future__ import annotations

import math
import statistics
from typing import Any

from ..strategies.decision import Measurement, decide
from . import sanity

WORKERS = (2, 4, 8, 16, 64)
LINKS_GBIT = (1.0, 10.0, 100.0)
DDP_BUCKET_BYTES = 25 * 2**20


def ring_seconds(n: int, nbytes: float, bandwidth: float, alpha: float, calls: float = 1.0) -> float:
    """Ring all-reduce time of ``nbytes`` over ``n`` workers: bandwidth in bytes/s, alpha in seconds."""
    if n <= 1:
        return 0.0
    return 2 * (n - 1) / n * nbytes / bandwidth + 2 * (n - 1) * alpha * calls


def _calls(row: dict[str, Any], nbytes: float) -> float:
    measured = row.get("calls_per_step") or 0.0
    if measured > 0:
        return measured
    if nbytes <= 0:
        return 1.0
    if row["kind"] == "ddp":  # DDP's reducer: one collective per bucket
        return float(max(1, math.ceil(nbytes / DDP_BUCKET_BYTES)))
    if row["setup"].startswith("allreduce"):  # phalanx fits the bucket to about a quarter of the gradients
        mb = nbytes / 2**20
        return float(math.ceil(mb / min(25.0, max(1.0, mb / 4))))
    return 1.0


def straggler_seconds(n: int, jitter_s: float) -> float:
    """Expected wait for the slowest of ``n`` workers: a synchronous step ends when the last one is done.

    With step times spread by ``jitter_s`` (standard deviation) the maximum of n exceeds the mean by about
    jitter·√(2 ln n) (the Gaussian extreme-value estimate).
    """
    return jitter_s * math.sqrt(2 * math.log(n)) if n > 1 else 0.0


def _jitter(row: dict[str, Any]) -> float:
    """Standard deviation of one worker's step time, from its windows' throughput (batch / samples/s)."""
    times = [row["batch"] / w for w in row.get("windows") or [] if w > 0]
    return float(statistics.stdev(times)) if len(times) > 1 else 0.0


def inputs(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per model: the 1-worker compute time and, per setup measured on N >= 2 workers, bytes and calls."""
    out: dict[str, dict[str, Any]] = {}
    for model in dict.fromkeys(r["model"] for r in rows):
        mine = [r for r in rows if r["model"] == model and r["samples_per_s"]["n"]]
        one = {r["setup"]: r for r in mine if r["workers"] == 1 and r["threads"] == 1}
        base = one.get("allreduce") or one.get("plain") or next(iter(one.values()), None)
        if base is None:
            continue
        compute = base["batch"] / base["samples_per_s"]["median"]
        setups: dict[str, dict[str, float]] = {}
        for r in mine:
            if r["workers"] >= 2 and r["kind"] != "plain" and r["setup"] not in setups:
                nbytes = float(r.get("bytes_per_step") or 0.0)
                t1 = one.get(r["setup"])  # its own 1-worker step time when measured (compression costs compute)
                setups[r["setup"]] = {"bytes": nbytes, "calls": _calls(r, nbytes),
                                      "compute_s": t1["batch"] / t1["samples_per_s"]["median"] if t1 else compute}
        if "allreduce" not in setups and base.get("grad_bytes"):
            nbytes = float(base["grad_bytes"])
            setups["allreduce"] = {"bytes": nbytes, "calls": _calls({"kind": "phalanx", "setup": "allreduce"}, nbytes),
                                   "compute_s": compute}
        grad_bytes = float(base.get("grad_bytes") or setups.get("allreduce", {}).get("bytes") or 0.0)
        out[model] = {"compute_s": compute, "batch": base["batch"], "setups": setups, "grad_bytes": grad_bytes,
                      "jitter_s": _jitter(base), "spread": sanity.relative_spread(base["samples_per_s"])}
    return out


def auto_pick(compute_s: float, grad_bytes: float, gbit: float, planned_steps: int | None = None,
              workers: int = 2) -> str:
    """What ``px.Auto`` would choose on a ``gbit`` link: the same :func:`phalanx.strategies.decision.decide`, fed the
    measured compute step and gradient bytes, the link's nominal rate and no overlap (this projection's assumption).

    Example:
        >>> auto_pick(0.06, 4e6, 10.0, 200).split(":")[0]
        'AllReduce()'
        >>> auto_pick(0.06, 4e6, 1.0, 200).split(":")[0]  # nothing overlapped: the 4-bit gradient pays at 1 Gbit/s
        'AllReduce(compression=Quantize(4, block=256, error_feedback=True))'
    """
    if grad_bytes <= 0:
        return "none: the gradient's size was not measured"
    d = decide(Measurement(compute_s=compute_s, grad_bytes=grad_bytes, rate=gbit * 1e9 / 8, overlap=0.0,
                           workers=workers), planned_steps)
    return f"{d.choice.describe()}: " + d.line(0).split(": ", 2)[2]


def project(rows: list[dict[str, Any]], alpha: float = 25e-6, threshold: float = 0.8,
            planned_steps: int | None = None) -> dict[str, Any]:
    """Efficiency and throughput per model, setup, link and N; a recommendation per model and link, and what
    ``px.Auto`` would pick there (:func:`auto_pick`) for a run of ``planned_steps``."""
    result: dict[str, Any] = {"label": "PROJECTION (not a measurement)", "alpha_s": alpha, "threshold": threshold,
                              "workers": list(WORKERS), "links_gbit": list(LINKS_GBIT), "models": {}}
    for model, inp in inputs(rows).items():
        table: dict[str, Any] = {}
        for setup, s in inp["setups"].items():
            table[setup] = {"bytes": s["bytes"], "calls": s["calls"], "compute_s": s["compute_s"], "links": {}}
            # The setup's own 1-worker time when it was measured faster than the reference is noise, not a
            # speedup: the reference is the faster of the two, so efficiency stays <= 1.
            ref = min(inp["compute_s"], s["compute_s"])
            for gbit in LINKS_GBIT:
                per_n = {}
                for n in WORKERS:
                    t = ring_seconds(n, s["bytes"], gbit * 1e9 / 8, alpha, s["calls"]) + straggler_seconds(
                        n, inp["jitter_s"])
                    per_n[n] = {"efficiency": min(1.0, ref / (s["compute_s"] + t)),
                                "samples_per_s": n * inp["batch"] / (s["compute_s"] + t)}
                table[setup]["links"][gbit] = per_n
        if inp["spread"] > sanity.NOISY:
            why = (f"none: the 1-worker measurement it rests on is too noisy (spread ±{100 * inp['spread']:.0f}% "
                   "of the median); rerun with more --steps or on an idle machine")
            recs = {g: why for g in LINKS_GBIT}
        else:
            recs = {g: recommend(table, g, threshold) for g in LINKS_GBIT}
        result["models"][model] = {"compute_s": inp["compute_s"], "batch": inp["batch"], "jitter_s": inp["jitter_s"],
                                   "setups": table, "recommendation": recs,
                                   "auto": {g: auto_pick(inp["compute_s"], inp["grad_bytes"], g, planned_steps)
                                            for g in LINKS_GBIT}}
    return result


# Setups whose updates match exact gradient averaging step for step (fp16 rounds the gradient, nothing more):
# their throughput alone decides between them. Every other setup (sparse or low-rank compression, local SGD,
# DiLoCo, EASGD, parameter servers) trades bytes for convergence per step, which a throughput model cannot see.
EXACT = ("allreduce", "ddp", "fp16", "ddp-fp16")


def _best(table: dict[str, Any], gbit: float, threshold: float, score: Any) -> tuple[float, str, int, float] | None:
    best: tuple[float, str, int, float] | None = None
    for setup, t in table.items():
        for n, p in t["links"][gbit].items():
            value = score(setup, p)
            if p["efficiency"] >= threshold and value is not None and (best is None or value > best[0]):
                best = (value, setup, n, p["efficiency"])
    return best


def recommend_by_throughput(table: dict[str, Any], gbit: float, threshold: float) -> str:
    """The old rule, kept to measure how far off it was: the highest projected throughput at efficiency >= threshold.

    Exact gradient averaging (allreduce, ddp) wins ties within 10%. It favours whatever sends the fewest bytes,
    even when that setup needs many more steps to the same quality.
    """
    best = _best(table, gbit, threshold,
                 lambda s, p: p["samples_per_s"] * (1.1 if s in ("allreduce", "ddp") else 1.0))
    if best is None:
        return _none(table, gbit, threshold)
    return f"{best[1]} on {best[2]} workers (projected efficiency {best[3]:.2f})"


def recommend(table: dict[str, Any], gbit: float, threshold: float,
              steps_to_target: dict[str, float] | None = None) -> str:
    """The setup and worker count to use on a ``gbit`` link, honest about what a throughput model cannot know.

    Without a quality measurement it picks, by projected throughput, only among setups that converge per step
    exactly like all-reduce (:data:`EXACT`), and names any other setup projected faster as one to check with
    ``python -m benchmarks.quality`` first. With ``steps_to_target`` (setup -> steps a time-to-quality run needed to
    reach its target, for the same global batch) it ranks by projected time to target, steps × step time.

    Example:
        >>> row = lambda sps: {"links": {1.0: {2: {"efficiency": 0.9, "samples_per_s": sps}}}}
        >>> pick, caveat = recommend({"ddp": row(100.0), "local-sgd": row(300.0)}, 1.0, 0.8).split("; ")
        >>> pick
        'ddp on 2 workers (projected efficiency 0.90)'
        >>> caveat.split(" but ")[0], caveat.endswith("measure it with python -m benchmarks.quality before choosing it")
        ('local-sgd projects 3.0x the throughput', True)
        >>> recommend({"ddp": row(100.0), "local-sgd": row(300.0)}, 1.0, 0.8, {"ddp": 100, "local-sgd": 400})
        'ddp on 2 workers (projected 1.33x sooner to target than local-sgd, from measured steps to target)'
    """
    if steps_to_target:
        best = _best(table, gbit, threshold, lambda s, p: p["samples_per_s"] / steps_to_target[s]
                     if steps_to_target.get(s, math.inf) < math.inf else None)
        if best is None:
            # no setup reached the target at all, or none of those that did keeps the efficiency threshold
            return "none: no setup reached the target" if not any(
                v < math.inf for v in steps_to_target.values()) else "none: no setup that reached the target " \
                "keeps the efficiency threshold"
        scores = sorted((p["samples_per_s"] / steps_to_target[s], s) for s, t in table.items()
                        for p in [t["links"][gbit][best[2]]] if steps_to_target.get(s, math.inf) < math.inf)
        runner = next(((v, s) for v, s in reversed(scores) if s != best[1]), None)
        vs = f" (projected {best[0] / runner[0]:.2f}x sooner to target than {runner[1]}, from " \
             "measured steps to target)" if runner else " (the only setup that reached the target)"
        return f"{best[1]} on {best[2]} workers{vs}"
    best = _best(table, gbit, threshold, lambda s, p: p["samples_per_s"] if s in EXACT else None)
    faster = _best(table, gbit, threshold, lambda s, p: p["samples_per_s"] if s not in EXACT else None)
    if best is None and faster is None:
        return _none(table, gbit, threshold)
    if best is None:
        text = f"none of the setups that converge like all-reduce keeps efficiency >= {threshold:.2f}"
        why = f"keeps efficiency {faster[3]:.2f}"  # type: ignore[index]
    else:
        text = f"{best[1]} on {best[2]} workers (projected efficiency {best[3]:.2f})"
        why = f"projects {faster[0] / best[0]:.1f}x the throughput" if faster else ""
    if faster is not None and (best is None or faster[0] > 1.1 * best[0]):
        text += (f"; {faster[1]} {why} but converges differently per step: measure it with "
                 "python -m benchmarks.quality before choosing it")
    return text


def _none(table: dict[str, Any], gbit: float, threshold: float) -> str:
    top = max(((p["efficiency"], s) for s, t in table.items() for p in [t["links"][gbit][WORKERS[0]]]
               if WORKERS[0] in t["links"][gbit]), default=(math.nan, "?"))
    return (f"no setup keeps efficiency >= {threshold:.2f} even at 2 workers (best: {top[1]} at "
            f"{top[0]:.2f}); data parallelism over this link does not pay for this model")


def markdown(proj: dict[str, Any]) -> str:
    ns = proj["workers"]
    out = [f"**{proj['label']}.** Ring all-reduce model T(N) = 2(N−1)/N·S/B + 2(N−1)·α·c with "
           f"α = {proj['alpha_s'] * 1e6:.0f} µs, no overlap of communication with compute (a lower bound for "
           "overlapping setups); compute time and bytes per step S are measured above. Sparse compressors (topk, "
           "threshold) exchange by all-gather, whose bytes grow with N, so their rows are optimistic. Efficiency "
           "per worker count N:\n"]
    for model, m in proj["models"].items():
        out.append(f"\n*{model}* (measured compute {m['compute_s'] * 1e3:.1f} ms/step at batch {m['batch']})\n")
        out.append("| setup | bytes/step | link | " + " | ".join(f"N={n}" for n in ns) + " |\n|---|---|---|" +
                   "---|" * len(ns) + "\n")
        for setup, t in m["setups"].items():
            for gbit, per_n in t["links"].items():
                cells = " | ".join(f"{per_n[n]['efficiency']:.2f}" for n in ns)
                out.append(f"| {setup} | {t['bytes'] / 1e6:.2f} MB | {gbit:g} Gbit/s | {cells} |\n")
        out.append("\nRecommendation (projected): " + "; ".join(
            f"{g:g} Gbit/s: {text}" for g, text in m["recommendation"].items()) + ".\n")
        if m.get("auto"):
            out.append("\n`px.Auto` would pick (its own decision, on the nominal rate, nothing overlapped): " +
                       "; ".join(f"{g:g} Gbit/s: {text}" for g, text in m["auto"].items()) + ".\n")
    return "".join(out)


def _phase(row: dict[str, Any], key: str) -> float:
    b = row.get("breakdown") or {}
    return statistics.fmean(v[key] for v in b.values()) if b else math.nan


def check(rows: list[dict[str, Any]], alpha: float = 25e-6) -> list[dict[str, Any]]:
    """The model against measured points: calibrated on 1 and 2 workers, compared at every N > 2 measured.

    From the 2-worker row of a setup (same host, loopback) come the link's effective bandwidth
    (its exposed communication time, less the latency term, for its bytes per step) and the
    compute slowdown of running more than one worker on one host (its compute phase over the
    1-worker one). ``before`` is the ring model as it stood (1-worker compute, no straggler
    wait); ``after`` adds the straggler wait and the measured compute slowdown.
    """
    out = []
    for r2 in rows:
        if r2["workers"] != 2 or r2["threads"] != 1 or r2["link"] != "loopback" or r2["kind"] == "plain":
            continue
        one = next((r for r in rows if r["model"] == r2["model"] and r["setup"] == r2["setup"] and r["workers"] == 1
                    and r["threads"] == 1), None)
        if one is None or not r2.get("bytes_per_step"):
            continue
        t1, c1, c2 = one["batch"] / one["samples_per_s"]["median"], _phase(one, "compute_s"), _phase(r2, "compute_s")
        nbytes, calls = float(r2["bytes_per_step"]), _calls(r2, float(r2["bytes_per_step"]))
        comm2 = max(_phase(r2, "comm_s") - ring_seconds(2, 0.0, 1.0, alpha, calls), 1e-6)
        bandwidth = nbytes / comm2  # ring at N=2 moves S bytes per worker
        slowdown = c2 / c1 if c1 > 0 else 1.0
        jitter = _jitter(one)
        for rn in rows:
            if (rn["model"], rn["setup"], rn["threads"], rn["link"]) != (r2["model"], r2["setup"], 1, "loopback") \
                    or rn["workers"] <= 2:
                continue
            n = rn["workers"]
            t = ring_seconds(n, nbytes, bandwidth, alpha, calls)
            before = t1 / (t1 + t)
            after = t1 / (t1 + (slowdown - 1) * c1 + t + straggler_seconds(n, jitter))
            out.append({"model": rn["model"], "setup": rn["setup"], "workers": n, "measured": rn["efficiency"],
                        "before": min(1.0, before), "after": min(1.0, after), "slowdown_2": slowdown,
                        "slowdown_n": _phase(rn, "compute_s") / c1 if c1 > 0 else math.nan,
                        "bandwidth_gbit": bandwidth * 8 / 1e9, "comm_measured_s": _phase(rn, "comm_s"),
                        "comm_model_s": t + straggler_seconds(n, jitter)})
    return out


def check_markdown(points: list[dict[str, Any]]) -> str:
    if not points:
        return "(no setup was measured on 1, 2 and more than 2 workers on loopback)\n"
    lines = ["| model | setup | N | measured efficiency | projected, ring model only | projected, + straggler wait "
             "and host slowdown | compute slowdown at 2 / at N | exposed comm measured / modelled (ms) |\n"
             "|---|---|---|---|---|---|---|---|\n"]
    for p in points:
        lines.append(f"| {p['model']} | {p['setup']} | {p['workers']} | {p['measured']:.2f} | {p['before']:.2f} "
                     f"({p['before'] - p['measured']:+.2f}) | {p['after']:.2f} ({p['after'] - p['measured']:+.2f}) | "
                     f"{p['slowdown_2']:.2f} / {p['slowdown_n']:.2f} | {1e3 * p['comm_measured_s']:.0f} / "
                     f"{1e3 * p['comm_model_s']:.0f} |\n")
    return "".join(lines)
