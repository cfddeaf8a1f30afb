"""``phalanx bench``: the scaling benchmark.

Example:
    phalanx bench --models mlp,resnet20,resnet56 --workers 1,2 \\
        --strategies allreduce,ddp,local-sgd,powersgd --link loopback,100mbit --out results/
    phalanx bench --quick --out results/

Writes ``bench.md`` (tables), ``bench.json`` (every raw step time and the environment)
and ``throughput.png``, ``efficiency.png``, ``breakdown.png`` into ``--out``.
"""
from __future__ import annotations

import argparse
import datetime
import os
import shlex
import sys
from typing import Any, Sequence

from ..errors import ConfigError, usage
from . import plots, projection, report, sanity, tta
from ..launch.netns import LinkError, parse_rate, why_not
from .runner import Options, sweep
from .spec import check_setup, parse_setup, plan, split_list

QUICK = {"models": "mlp,resnet20", "workers": "1,2", "strategies": "allreduce,ddp", "warmup": 3, "steps": 8}
FULL = {"models": "mlp,resnet20", "workers": "1,2", "strategies": "allreduce,ddp", "warmup": 5, "steps": 32}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="phalanx bench", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Measure samples/s, speedup, efficiency and where the step time goes, for each model, "
                    "setup, worker count and link. Setups: plain (added automatically), ddp, ddp-fp16, "
                    "ddp-powersgd (torch's own), and any registered phalanx strategy; arguments in brackets, "
                    "e.g. 'allreduce[bucket_mb=2]'.",
        epilog="examples:\n  phalanx bench --quick --out results/\n"
               "  phalanx bench --models mlp,resnet20 --workers 1,2 --strategies allreduce,ddp,local-sgd,powersgd "
               "--link loopback,100mbit --out results/\n"
               "  phalanx bench --time-to-accuracy --strategies ddp,ddp-powersgd,allreduce,local-sgd,powersgd "
               "--link 100mbit --models mlp --out results/link\n"
               "  phalanx bench --keras --help      (Keras 3 through px.keras beside plain PyTorch; its own options)")
    p.add_argument("--models", help=f"comma list from phalanx.bench.models.ZOO (default {FULL['models']})")
    p.add_argument("--workers", help="comma list of worker process counts (default 1,2)")
    p.add_argument("--strategies", help="comma list of setups (default allreduce,ddp)")
    p.add_argument("--threads", help="plain loop in 1 process x T threads, comma list (default: worker counts above 1)")
    p.add_argument("--link", default="loopback", help="comma list: loopback and/or rates such as 100mbit (needs root)")
    p.add_argument("--batch", type=int, default=64, help="samples per worker per step (default 64)")
    p.add_argument("--warmup", type=int, help="steps left out before timing (default 5)")
    p.add_argument("--steps", type=int, help="timed steps per configuration (default 32, a multiple of local SGD's k)")
    p.add_argument("--repeats", type=int, default=1, help="run the whole list this many times, alternating order")
    p.add_argument("--quick", action="store_true", help="a small sweep that finishes in under 3 minutes on 2 cores")
    p.add_argument("--time-to-accuracy", action="store_true",
                   help="also train the digits CNN to --target-acc with each setup on max(--workers) workers, "
                        "on each shaped link (on loopback when --link has none)")
    p.add_argument("--target-acc", type=float, default=tta.DEFAULTS["target"], help="test accuracy to reach (0.95)")
    p.add_argument("--tta-max-epochs", type=int, default=tta.DEFAULTS["max_epochs"], help="give up after (30)")
    p.add_argument("--planned-steps", type=int, default=None,
                   help="the run length px.Auto's pick in the projection assumes (default: px.Auto's own, 10000)")
    p.add_argument("--alpha-us", type=float, default=25.0, help="per-message latency for the projection (µs)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per configuration before it is killed")
    p.add_argument("--out", default="results", help="output directory (default results/)")
    p.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    p.add_argument("--no-progress", action="store_true", help="no progress bar (one line per run still)")
    p.add_argument("--from-json", metavar="BENCH_JSON",
                   help="run nothing: rebuild the tables, checks and plots from an earlier bench.json into --out")
    return p


def _ints(text: str, what: str) -> list[int]:
    try:
        values = [int(v) for v in split_list(text)]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise ConfigError(usage(f"--{what} {text!r}", "a comma list of integers >= 1", f"E.g. --{what} 1,2."))
    return values


def resolve(args: argparse.Namespace) -> dict[str, Any]:
    """Validate everything before the first process starts."""
    from .models import ZOO

    preset = QUICK if args.quick else FULL
    models = split_list(args.models or preset["models"])
    unknown = [m for m in models if m not in ZOO]
    if unknown:
        raise ConfigError(usage(f"--models {','.join(unknown)}", "names from " + ", ".join(ZOO), "Fix the list."))
    workers = _ints(args.workers or preset["workers"], "workers")
    threads = _ints(args.threads, "threads") if args.threads else [n for n in workers if n > 1]
    setups = [parse_setup(s) for s in split_list(args.strategies or preset["strategies"])]
    for s in setups:
        check_setup(s)
    links = ["loopback" if x.strip().lower() == "loopback" else parse_rate(x) for x in split_list(args.link)]
    if any(link != "loopback" for link in links):
        reason = why_not()
        if reason:
            raise LinkError(f"cannot build the {', '.join(x for x in links if x != 'loopback')} link: {reason}")
    warmup = preset["warmup"] if args.warmup is None else args.warmup
    steps = preset["steps"] if args.steps is None else args.steps
    if warmup < 0 or steps < 1 or args.batch < 1 or args.repeats < 1:
        raise ConfigError(usage(f"--warmup {warmup} --steps {steps} --batch {args.batch} --repeats {args.repeats}",
                                "warmup >= 0 and steps, batch, repeats >= 1", "Fix the numbers."))
    if warmup < 2 and any(s.name == "ddp-powersgd" for s in setups):
        raise ConfigError(usage(f"--warmup {warmup} with ddp-powersgd", "--warmup >= 2",
                                "DDP's PowerSGD hook runs plain all-reduce for its first 2 steps."))
    return {"models": models, "workers": workers, "threads": threads, "setups": setups, "links": links,
            "opts": Options(warmup=warmup, steps=steps, repeats=args.repeats, timeout=args.timeout,
                            progress=not args.no_progress)}


def _describe(record: dict[str, Any]) -> str:
    rows = report.aggregate([record])
    s = rows[0]["samples_per_s"]
    return f"{s['median']:,.0f} samples/s (median of {s['n']})"


def _describe_tta(record: dict[str, Any]) -> str:
    reached = record["ranks"][0].get("reached")
    return f"target reached after {reached['seconds']:.2f} s of training" if reached else "target not reached"


def rerender(path: str, out: str, *, no_plots: bool = False) -> str:
    """Rebuild ``bench.md``, ``bench.json`` and the plots in ``out`` from the raw records of an earlier run."""
    import json

    with open(path) as f:
        payload = json.load(f)
    rows = report.aggregate(payload["raw"])
    alpha, planned = payload["options"].get("alpha_us", 25.0) * 1e-6, payload["options"].get("planned_steps")
    payload.update(rows=rows,
                   projection={**projection.project(rows, alpha=alpha, planned_steps=planned),
                               "check": projection.check(rows, alpha=alpha)},
                   warnings=sanity.warnings(rows, payload["environment"]))
    os.makedirs(out, exist_ok=True)
    pngs = [] if no_plots else plots.all_plots(rows, out)
    md = render(payload, [os.path.basename(p) for p in pngs])
    report.write_json(os.path.join(out, "bench.json"), payload)
    with open(os.path.join(out, "bench.md"), "w") as f:
        f.write(md)
    return md


def main(argv: Sequence[str] | None = None) -> int:
    # -- `phalanx bench --keras`: Keras 3 beside the same model in plain PyTorch (phalanx.bench.keras_setup) --
    if "--keras" in (sys.argv[1:] if argv is None else argv):
        from .keras_setup import main as keras_main
        return keras_main([a for a in (sys.argv[1:] if argv is None else argv) if a != "--keras"])
    # -- end of --keras --
    args = parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    if args.from_json:
        print(rerender(args.from_json, args.out, no_plots=args.no_plots))
        return 0
    cfg = resolve(args)
    os.makedirs(args.out, exist_ok=True)
    opts: Options = cfg["opts"]
    started = datetime.datetime.now(datetime.timezone.utc)
    load_at_start = os.getloadavg() if hasattr(os, "getloadavg") else None
    runs = plan(cfg["models"], cfg["setups"], cfg["workers"], cfg["threads"], cfg["links"], batch=args.batch)
    records = sweep(runs, opts, describe=_describe)
    rows = report.aggregate(records)
    tta_records: list[dict[str, Any]] = []
    if args.time_to_accuracy:
        n = max(cfg["workers"])
        shaped = [link for link in cfg["links"] if link != "loopback"] or cfg["links"]
        tta_runs = plan(["digits_cnn"], cfg["setups"], [n], [], shaped, batch=tta.DEFAULTS["batch"], plain=False)
        tta_records = sweep(tta_runs, opts, module="phalanx.bench.tta", desc="time to accuracy",
                            make_config=lambda run, o: tta.config(run, o, target=args.target_acc,
                                                                  max_epochs=args.tta_max_epochs),
                            describe=_describe_tta)
    tta_rows = tta.rows(tta_records)
    proj = projection.project(rows, alpha=args.alpha_us * 1e-6, planned_steps=args.planned_steps)
    proj["check"] = projection.check(rows, alpha=args.alpha_us * 1e-6)
    command = "phalanx bench " + " ".join(shlex.quote(a) for a in (sys.argv[1:] if argv is None else argv))
    payload = {"command": command, "started": started.isoformat(timespec="seconds"),
               "finished": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
               "environment": {**report.environment(cfg["links"]), "loadavg_at_start": load_at_start},
               "options": {**vars(opts), "batch": args.batch, "alpha_us": args.alpha_us,
                           "planned_steps": args.planned_steps},
               "rows": rows, "time_to_accuracy": tta_rows, "projection": proj,
               "raw": records, "raw_time_to_accuracy": tta_records}
    payload["warnings"] = sanity.warnings(rows, payload["environment"])
    for line in payload["warnings"]:
        print(f"phalanx bench: warning: {line}", file=sys.stderr)
    pngs = [] if args.no_plots else plots.all_plots(rows, args.out)
    md = render(payload, [os.path.basename(p) for p in pngs])
    report.write_json(os.path.join(args.out, "bench.json"), payload)
    with open(os.path.join(args.out, "bench.md"), "w") as f:
        f.write(md)
    print(md)
    print(f"wrote {os.path.join(args.out, 'bench.md')}, bench.json" + "".join(f", {os.path.basename(p)}" for p in pngs))
    failed = sum(1 for r in records + tta_records if r["error"])
    if failed:
        print(f"phalanx bench: {failed} configuration(s) failed; see the tables", file=sys.stderr)
    return 1 if failed else 0


def _load(values: Any) -> str:
    return "(" + ", ".join(f"{x:.2f}" for x in values) + ")" if values else "n/a"


def render(payload: dict[str, Any], pngs: list[str]) -> str:
    env, rows = payload["environment"], payload["rows"]
    o = payload["options"]
    parts = [f"# phalanx bench: {payload['started']}\n\n",
             f"Command: `{payload['command']}`\n\n",
             f"Machine: {env['cpu']}, {env['cpu_count']} cores, torch {env['torch']}, GPU: {env['gpu'] or 'none'}; "
             f"load average (1, 5, 15 min) at the start {_load(env['loadavg_at_start'])}, at the end "
             f"{_load(env['loadavg_at_end'])} (the end figure includes the benchmark's own workers). "
             f"Warm-up {o['warmup']} steps left out, then {o['steps']} timed steps, {o['repeats']} repeat(s); "
             f"batch {o['batch']} per worker; synthetic data; one intra-op thread per worker process.\n\n",
             *(["## Warnings\n\n"] + [f"- {w}\n" for w in payload.get("warnings", [])] + ["\n"]
               if payload.get("warnings") else []),
             "## Throughput (measured)\n\n", report.throughput_table(rows),
             "\nSpeedup is thpt(N)/thpt(1) of the same setup (thread rows: against the plain loop 1×1); "
             "efficiency is speedup/N. The spread is the 2.5th to 97.5th percentile of the timed windows; a ratio "
             "marked ~ compares two rows whose spreads overlap, so it does not say which is faster.\n\n"
             "## Where the time goes (measured, mean per timed step and worker)\n\n", report.breakdown_table(rows),
             "\n*optimizer step* includes the strategy's own work around `optimizer.step()` other than collectives "
             "(e.g. compression); *phases / step*: the four phases, timed by hooks, over the loop's own step time "
             "(median ratio over steps).\n"]
    wire = report.wire_table(rows)
    if wire:
        parts += ["\n## Bytes on the shaped link\n\n", wire]
    servers = report.server_table(rows)
    if servers:
        parts += ["\n## Parameter-server load (counted by the servers, warm-up and timed steps together)\n\n", servers]
    if payload["time_to_accuracy"]:
        parts += ["\n## Time to target accuracy (measured; digits CNN, training time without evaluation)\n\n",
                  tta.table(payload["time_to_accuracy"])]
    parts += ["\n## PROJECTION (not a measurement)\n\n", projection.markdown(payload["projection"])]
    if payload["projection"].get("check"):
        parts += ["\n### The projection against the measured points\n\nCalibrated on 1 and 2 workers of this host "
                  "(loopback bandwidth from the 2-worker exposed communication), compared where more workers were "
                  "measured; in brackets, projected minus measured.\n\n",
                  projection.check_markdown(payload["projection"]["check"])]
    if pngs:
        parts += ["\n## Plots\n\n"] + [f"![{p}]({p})\n" for p in pngs]
    return "".join(parts)
