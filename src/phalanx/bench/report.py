"""Turn raw worker records into rows, a markdown report and a JSON file.

A *row* is one configuration (model, setup, processes x threads, link) with its
windows pooled over repeats: median samples/s with spread (mean ± 1.96·std),
speedup and efficiency against the same setup on one worker (the plain loop in
1 process x 1 thread for the plain loop's thread rows), ratios to the plain loop
and to DDP on the same worker count and link, bytes per step, and the per-worker
breakdown of the step time.
"""
from __future__ import annotations

import json
import math
import os
import platform
import statistics
from collections import defaultdict
from typing import Any, Sequence

from . import sanity, stats
from .breakdown import LABELS, PHASES
from .spec import Setup

PLAIN = "plain"


def aggregate(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per configuration, in first-seen order."""
    groups: dict[tuple, list[dict[str, Any]]] = defaultdict(list)
    for rec in records:
        r = rec["run"]
        groups[(r["model"], r["setup"]["label"], r["workers"], r["threads"], r["link"])].append(rec)
    rows = [_row(key, recs) for key, recs in groups.items()]
    by_key = {(r["model"], r["setup"], r["workers"], r["threads"], r["link"]): r for r in rows}
    for row in rows:
        med = row["samples_per_s"]["median"]
        plain = by_key.get((row["model"], PLAIN, 1, 1, "loopback"))
        if row["setup"] == PLAIN:
            base, n = plain, row["threads"]
        else:
            base, n = by_key.get((row["model"], row["setup"], 1, 1, "loopback")) or plain, row["workers"]
        base_med = base["samples_per_s"]["median"] if base else math.nan
        row["speedup"], row["efficiency"] = stats.speedup(med, base_med, n)
        row["speedup_base"] = f"{base['setup']} 1x1" if base else None
        row["vs_plain"] = med / plain["samples_per_s"]["median"] if plain else math.nan
        ddp = by_key.get((row["model"], "ddp", row["workers"], 1, row["link"]))
        other = row["kind"] != "plain" and row["setup"] != "ddp"
        row["vs_ddp"] = med / ddp["samples_per_s"]["median"] if ddp and other else math.nan
        # a ratio whose two spreads overlap does not say which side is faster
        s = row["samples_per_s"]
        row["vs_plain_within_noise"] = (bool(plain) and plain is not row
                                        and sanity.within_noise(s, plain["samples_per_s"]))
        row["vs_ddp_within_noise"] = bool(ddp and other) and sanity.within_noise(s, ddp["samples_per_s"])
    return rows


def _row(key: tuple, recs: list[dict[str, Any]]) -> dict[str, Any]:
    model, label, workers, threads, link = key
    run = recs[0]["run"]
    ok = [r for r in recs if not r["error"] and r["ranks"]]
    row: dict[str, Any] = {"model": model, "setup": label, "kind": _kind(run["setup"]["name"]),
                           "workers": workers, "threads": threads, "link": link, "batch": run["batch"],
                           "repeats": len(recs), "errors": [r["error"] for r in recs if r["error"]]}
    thpt: list[float] = []
    phases: dict[int, list[dict[str, float]]] = defaultdict(list)
    check: list[float] = []
    for rec in ok:
        ranks = rec["ranks"]
        w, period = ranks[0]["warmup"], max(r["period"] for r in ranks)
        thpt += stats.window_throughput([stats.timed(r["step_s"], w) for r in ranks], run["batch"], period)
        for r in ranks:
            timed_phases = r["phases"][w:]
            phases[r["rank"]] += timed_phases
            # the probe's phases against the loop's own clock, step by step
            pairs = zip(timed_phases, r["step_s"][w:], strict=True)
            check += [sum(p[k] for k in PHASES) / s for p, s in pairs if s > 0]
    row["samples_per_s"] = stats.summary(thpt)
    row["windows"] = thpt
    # means, not medians: means of the phases add up to the mean step, and a periodic rule's
    # sync steps (one in k) count in full instead of vanishing under the median
    row["breakdown"] = {rank: {k: statistics.fmean(p[k] for p in ps) for k in (*PHASES, "step_s")}
                        for rank, ps in sorted(phases.items()) if ps}
    row["breakdown_sum_ratio"] = statistics.median(check) if check else math.nan
    first = [r["ranks"] for r in ok]
    if first:
        ranks = first[0]
        row["params"], row["grad_bytes"], row["period"] = ranks[0]["params"], ranks[0]["grad_bytes"], ranks[0]["period"]
        row["bytes_per_step"] = statistics.median(r["bytes_per_step"] for rs in first for r in rs)
        row["calls_per_step"] = statistics.median(r["calls_per_step"] for rs in first for r in rs)
        wire = [r["wire_bytes_per_step"] for rs in first for r in rs if r.get("wire_bytes_per_step") is not None]
        row["wire_bytes_per_step"] = statistics.median(wire) if wire else None
        row["extra"] = [r.get("extra") or {} for r in ranks]
        peaks = [r["peak_rss_bytes"] for rs in first for r in rs if r.get("peak_rss_bytes")]
        row["peak_rss_bytes"] = max(peaks) if peaks else None  # the worker that needed the most
    return row


def _kind(name: str) -> str:
    return Setup(name).kind


# -- formatting ---------------------------------------------------------------------------------
def fmt(x: float | None, spec: str, empty: str = "") -> str:
    return empty if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def fmt_bytes(n: float | None) -> str:
    if n is None or (isinstance(n, float) and math.isnan(n)):
        return ""
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"


def setup_name(row: dict[str, Any]) -> str:
    if row["kind"] == "plain":
        return "plain PyTorch loop"
    return ("phalanx " if row["kind"] == "phalanx" else "") + row["setup"].replace("ddp", "torch DDP", 1)


def row_label(row: dict[str, Any], rank: Any = None) -> str:
    """How a row (and one worker of it) is named in every table and plot."""
    link = row["link"] if row["workers"] > 1 else "–"
    text = f"{row['model']} | {setup_name(row)} | {link} | {row['workers']}×{row['threads']}"
    return text if rank is None else f"{text} | worker {rank}"


def _ratio(x: float, noise: bool) -> str:
    return fmt(x, ".3f") + (" ~" if noise and not math.isnan(x) else "")


def throughput_table(rows: list[dict[str, Any]]) -> str:
    head = ("| model | setup | link | processes × threads | samples/s (median) | spread (2.5–97.5 pct) | speedup | "
            "efficiency | × plain 1×1 | × DDP same N | bytes/step | peak RSS/worker |\n"
            "|---|---|---|---|---|---|---|---|---|---|---|---|\n")
    lines = []
    for r in rows:
        s = r["samples_per_s"]
        if r["errors"] and not s["n"]:
            lines.append(f"| {r['model']} | {setup_name(r)} | {r['link']} | {r['workers']}×{r['threads']} | "
                         f"failed: {r['errors'][0][:120]} | | | | | | | |")
            continue
        lines.append(
            f"| {r['model']} | {setup_name(r)} | {r['link'] if r['workers'] > 1 else '–'} | "
            f"{r['workers']}×{r['threads']} | {s['median']:,.0f} | {s['low']:,.0f}–{s['high']:,.0f} | "
            f"{fmt(r['speedup'], '.2f')}x | {fmt(100 * r['efficiency'], '.1f')}% | "
            f"{_ratio(r['vs_plain'], r.get('vs_plain_within_noise', False))} | "
            f"{_ratio(r['vs_ddp'], r.get('vs_ddp_within_noise', False))} | "
            f"{fmt_bytes(r.get('bytes_per_step')) if r['workers'] > 1 else ''} | "
            f"{fmt_bytes(r.get('peak_rss_bytes'))} |")
    return head + "\n".join(lines) + "\n"


def breakdown_table(rows: list[dict[str, Any]]) -> str:
    head = ("| model | setup | link | processes × threads | worker | step ms (mean) | " +
            " | ".join(LABELS[k] for k in PHASES) +
            " | phases / step |\n|---|---|---|---|---|---|" + "---|" * len(PHASES) + "---|\n")
    lines = []
    for r in rows:
        for rank, b in r.get("breakdown", {}).items():
            step = b["step_s"]
            parts = " | ".join(f"{1e3 * b[k]:.1f} ({100 * b[k] / step:.0f}%)" for k in PHASES)
            lines.append(f"| {row_label(r, rank).replace('worker ', '')} | {1e3 * step:.1f} | {parts} | "
                         f"{fmt(r['breakdown_sum_ratio'], '.2f')} |")
    return head + "\n".join(lines) + "\n"


def wire_table(rows: list[dict[str, Any]]) -> str:
    shaped = [r for r in rows if r.get("wire_bytes_per_step") is not None]
    if not shaped:
        return ""
    lines = [f"| {r['model']} | {setup_name(r)} | {r['link']} | {fmt_bytes(r['bytes_per_step'])} | "
             f"{fmt_bytes(r['wire_bytes_per_step'])} |" for r in shaped]
    return ("| model | setup | link | payload bytes/step (reported) | bytes/step on the wire (veth tx) |\n"
            "|---|---|---|---|---|\n" + "\n".join(lines) + "\n")


def server_table(rows: list[dict[str, Any]]) -> str:
    """Per-server load of parameter-server setups (rank 0's view; counters since the servers started)."""
    lines = []
    for r in rows:
        load = next((e["servers"] for e in r.get("extra") or [] if e.get("servers")), None)
        if not load:
            continue
        for i in range(len(load["addrs"])):
            lines.append(f"| {r['model']} | {setup_name(r)} | {r['link']} | {r['workers']} | {i} | "
                         f"{load['bytes_in'][i] / 1e6:.1f} | {load['bytes_out'][i] / 1e6:.1f} | "
                         f"{load['requests'][i]} | {load['bytes_held'][i] / 1e6:.2f} | "
                         f"{load['bytes_imbalance']:.2f} | {load['requests_imbalance']:.2f} |")
    if not lines:
        return ""
    return ("| model | setup | link | workers | server | MB in | MB out | requests | MB held | bytes max/mean | "
            "requests max/mean |\n|---|---|---|---|---|---|---|---|---|---|---|\n" + "\n".join(lines) + "\n")


def environment(links: list[str]) -> dict[str, Any]:
    """What the numbers were measured on."""
    import torch

    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu)
    except OSError:
        pass
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    return {"torch": torch.__version__, "python": platform.python_version(), "cpu": cpu,
            "cpu_count": os.cpu_count(), "gpu": gpu, "torch_threads_default": torch.get_num_threads(),
            "platform": platform.platform(), "links": links, "loadavg_at_end": load}


def run_header(command: str, argv: Sequence[str] | None, started: str, options: Any) -> dict[str, Any]:
    """What every results file opens with: the command line, its start, the machine and the parsed options.

    ``argv`` is what the command was given (``None``: this process's own ``sys.argv[1:]``).

    Example:
        >>> run_header("phalanx bench --keras", ["--repeats", "1"], "2026-01-01T00:00:00", {})["command"]
        'phalanx bench --keras --repeats 1'
    """
    import sys

    args = sys.argv[1:] if argv is None else argv
    return {"command": command + " " + " ".join(args), "started": started, "environment": environment(["loopback"]),
            "options": dict(vars(options)) if hasattr(options, "__dict__") else dict(options)}


def write_report(out: str, name: str, payload: dict[str, Any], md: str) -> None:
    """``out/<name>.json`` (the payload, strict JSON) and ``out/<name>.md`` (the tables), and the tables printed.

    Example:
        >>> # write_report(args.out, "gpu", payload, markdown(payload))
    """
    os.makedirs(out, exist_ok=True)
    write_json(os.path.join(out, f"{name}.json"), payload)
    with open(os.path.join(out, f"{name}.md"), "w") as f:
        f.write(md)
    print(md)


def write_json(path: str, payload: dict[str, Any]) -> None:
    """Strict JSON (nan becomes null), written atomically."""
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(_clean(payload), f, indent=1, default=str, allow_nan=False)
    os.replace(tmp, path)


def _clean(x: Any) -> Any:
    if isinstance(x, float):
        return None if math.isnan(x) or math.isinf(x) else x
    if isinstance(x, dict):
        return {str(k): _clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_clean(v) for v in x]
    return x
