"""``python -m benchmarks.quality`` (also ``python -m benchmarks.quality``): time to quality on slow links.

Example:
    python -m benchmarks.quality --out results/quality                 # the full benchmark (root)
    python -m benchmarks.quality --smoke --out /tmp/q                   # a minute, loopback when not root

Writes ``quality.md``, ``quality.json`` and ``quality-TASK-LINK.png`` into ``--out``.
"""
from __future__ import annotations

import argparse
import datetime
import os
import shlex
import sys
import time
from typing import Any, Sequence

from phalanx.errors import ConfigError, usage
from phalanx.launch.netns import LinkError, parse_rate, why_not
from phalanx.bench.report import environment, write_json
from phalanx.bench.runner import terminate_unwinds, links_for
from phalanx.bench.spec import split_list
from . import advisor, curves, plan, report, sessions, targets
from .setups import SETUPS, peer_reasons
from .torchft_peer import PEERS as TORCHFT_PEERS
from .tasks import TASKS, get

SMOKE = {"tasks": "gpt", "setups": "ddp,local-sgd", "repeats": 1, "budget": 1.0, "sweep": "",
         "targets": "gpt=5.0", "evals": 2}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.quality", description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tasks", default="gpt,resnet20", help="comma list from " + ", ".join(TASKS))
    p.add_argument("--setups", default=None, help="comma list (default: all; torchft's when it is importable)")
    p.add_argument("--link", default="10mbit,100mbit,1gbit", help="comma list: rates (root) and/or loopback")
    p.add_argument("--repeats", type=int, default=3, help="repeats of every run (default 3)")
    p.add_argument("--budget", type=float, help="training seconds per run (default: each task's own)")
    p.add_argument("--targets", default="", help="override targets, e.g. gpt=2.2,resnet20=0.6")
    p.add_argument("--sweep", default="", metavar="MULTIPLIERS",
                   help="redo the lr sweep on loopback with these multipliers of each family's base lr, e.g. "
                        "0.5,1,2 (default: the committed sweep's lrs, bench/quality/lrs.json)")
    p.add_argument("--sweep-steps", type=int, default=120, help="steps per sweep run (default 120)")
    p.add_argument("--sweep-cap", type=float, default=600.0, help="at most this many seconds per sweep run")
    p.add_argument("--fast-setups", default=",".join(plan.FAST_SETUPS),
                   help="the setups run on links of 1 Gbit/s and faster ('all' = every one of --setups)")
    p.add_argument("--evals", type=int, default=8, help="evaluations per run, evenly spaced in training time")
    p.add_argument("--smoke", action="store_true", help="one-minute check: GPT, DDP, local SGD, 1 s each")
    p.add_argument("--from-json", metavar="PATH", help="no run: the report of a stored quality.json again (a comma "
                   "list: merged), e.g. with other --targets (the same for every setup)")
    p.add_argument("--dry-run", action="store_true", help="print the plan and its estimated duration, run nothing")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per run before it is killed")
    p.add_argument("--out", default="results/quality", help="output directory")
    p.add_argument("--no-progress", action="store_true")
    return p


def _floats(text: str, what: str) -> list[float]:
    try:
        vals = [float(x) for x in split_list(text)]
    except ValueError:
        vals = [-1.0]
    if any(v <= 0 for v in vals):
        raise ConfigError(usage(f"--{what} {text!r}", "a comma list of positive numbers", f"E.g. --{what} 0.5,1,2."))
    return vals


def resolve(args: argparse.Namespace) -> dict[str, Any]:
    """Validate everything before the first process starts."""
    if args.smoke:
        for key, value in SMOKE.items():
            setattr(args, key, value)
        args.link = "100mbit" if why_not() is None else "loopback"
    tasks = [get(t).name for t in split_list(args.tasks)]
    left_out = peer_reasons()
    setups = split_list(args.setups) if args.setups is not None else [
        *plan.ALL_SETUPS, *(s for s in TORCHFT_PEERS if s not in left_out)]
    bad = [s for s in setups if s not in SETUPS or s in left_out]
    if bad:
        # every setup a run accepts (the variants too), not only the default list
        raise ConfigError(usage(f"--setups {','.join(bad)}", "names from " + ", ".join(
            s for s in SETUPS if s not in left_out), "Fix the list." + "".join(
                f" {k}: {v}." for k, v in left_out.items() if k in bad)))
    links = ["loopback" if x.lower() == "loopback" else parse_rate(x) for x in split_list(args.link)]
    if any(x != "loopback" for x in links) and why_not():
        raise LinkError(f"cannot build the shaped links: {why_not()}")
    if args.repeats < 1 or args.sweep_steps < 1 or args.evals < 1 or (args.budget is not None and args.budget <= 0):
        raise ConfigError(usage(f"--repeats {args.repeats} --sweep-steps {args.sweep_steps} --budget {args.budget}",
                                "repeats, sweep steps, evals >= 1 and budget > 0", "Fix the numbers."))
    targets = {t: get(t).target for t in tasks}
    for part in split_list(args.targets):
        name, _, value = part.partition("=")
        if name not in targets:
            raise ConfigError(usage(f"--targets {part!r}", "TASK=VALUE for a task in --tasks", "E.g. gpt=2.2."))
        targets[name] = _floats(value, "targets")[0]
    return {"tasks": tasks, "setups": setups, "links": links, "targets": targets,
            "budgets": {t: args.budget for t in tasks if args.budget},  # the rest: budgets(), once measured
            "sweep": tuple(_floats(args.sweep, "sweep")) if args.sweep else ()}


#: A run trains for this many times its task's budget: issue 41 counts a seed as reaching the target "within 1.25x
#: the budget". The budget's step is one worker's, measured alone (:func:`compute_seconds`), and two workers side by
#: side on this machine's 2 cores step 20-35% slower, so runs held to 1.0x got 20-35% fewer steps than the task's
#: budget and some rules ran out of time just short of the target (benchmarks/reports/quality.md, 2026-11-29).
REACHED_WITHIN = 1.25


def budgets(tasks: list[str], compute: dict[str, float], given: dict[str, float]) -> dict[str, float]:
    """Training seconds per run: ``--budget`` where given, else :data:`REACHED_WITHIN` times the task's
    ``budget_steps`` of compute as measured today, so that a target stays reachable (and equally far) on a day the
    machine runs slower or faster.

        >>> budgets(["gpt"], {"gpt": 0.15}, {})
        {'gpt': 33.8}
    """
    return {t: given.get(t) or round(REACHED_WITHIN * get(t).budget_steps * compute[t], 1) for t in tasks}


def compute_seconds(task: str, steps: int = 4, warmup: int = 2) -> float:
    """One worker's step time with no communication (1 thread, median of ``steps`` after ``warmup`` steps).

    The first two steps of a fresh model run 10-90% slower than the rest (allocations, kernel choices), so they
    are left out. Even so the machine's own speed moves it by 10-25% within an hour: it sets each run's budget, and
    the compute-only bound takes the ``compute-only`` runs' step where an invocation has them.
    """
    import statistics

    import torch

    t = get(task)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        torch.manual_seed(0)
        model = t.model()
        opt = t.optim.build(model.parameters(), t.optim.lr)
        times = []
        for i in range(steps + warmup):
            x, y = t.batch(i, 0, 1, t.per_worker)
            start = time.perf_counter()
            opt.zero_grad()
            t.loss(model(x), y).backward()
            opt.step()
            times.append(time.perf_counter() - start)
        return statistics.median(times[warmup:])
    finally:
        torch.set_num_threads(threads)


def _items(runs: list[plan.QRun], repeats: int, evals: int) -> list[sessions.Item]:
    """Repeat k runs the list forwards when k is even and backwards when odd: a slow drift hits every setup alike."""
    return [sessions.Item(r, k, plan.config(r, k, evals=evals)) for k in range(repeats)
            for r in (runs if k % 2 == 0 else runs[::-1])]


class _Progress:
    """One line per finished run (elapsed, done/total, estimate left) and the partial results on disk."""

    def __init__(self, total: int, estimate_s: float, quiet: bool, on_record: Any = None) -> None:
        self.total, self.estimate, self.quiet, self.on_record = total, estimate_s, quiet, on_record
        self.started, self.records = time.monotonic(), []  # type: ignore[var-annotated]

    def __call__(self, record: dict[str, Any]) -> None:
        self.records.append(record)
        elapsed = time.monotonic() - self.started
        left = elapsed / len(self.records) * (self.total - len(self.records))
        r = record["run"]
        what = f"FAILED ({record['error'][:200]})" if record["error"] else _describe(record)
        if not self.quiet:
            print(f"[{elapsed / 60:5.1f} min, {len(self.records)}/{self.total}, ~{left / 60:.0f} min left] "
                  f"{r['task']} {r['setup']} {r['link']} repeat {record['repeat']}: {what}", file=sys.stderr,
                  flush=True)
        if self.on_record is not None:
            self.on_record(self.records)


def run_sweep(tasks: list[str], setups: list[str], multipliers: tuple[float, ...], args: argparse.Namespace,
              higher: dict[str, bool]) -> tuple[dict[tuple[str, str], dict[str, Any]], list[dict[str, Any]]]:
    """The lr sweep on loopback, in one session: every setup × multiplier for the same steps, final quality."""
    runs = plan.sweep_runs(tasks, setups, multipliers, steps=args.sweep_steps, cap_s=args.sweep_cap)
    progress = _Progress(len(runs), plan.estimate_s(runs), args.no_progress)
    records = sessions.run_session(_items(runs, 1, 1), None, timeout=args.timeout, on_record=progress)
    chosen = plan.choose_lrs(records, higher, {t: get(t).sweep_band for t in tasks})
    stored = {"command": "python -m benchmarks.quality " + " ".join(shlex.quote(a) for a in sys.argv[1:]),
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "steps": args.sweep_steps, "multipliers": list(multipliers), "loadavg": os.getloadavg(),
              "lrs": {t: {s: v for (t2, s), v in chosen.items() if t2 == t} for t in tasks}}
    write_json(os.path.join(args.out, "lrs.json"), stored)
    return chosen, records


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser().parse_args(argv)
    if args.from_json:
        return reanalyse(args.from_json, args.targets, args.out)
    cfg = resolve(args)
    tasks, higher = cfg["tasks"], {t: get(t).higher_is_better for t in cfg["tasks"]}
    fast = None if args.fast_setups == "all" else tuple(split_list(args.fast_setups))
    started = datetime.datetime.now(datetime.timezone.utc)
    compute = {t: compute_seconds(t, steps=2 if args.smoke else 12) for t in tasks}
    cfg["budgets"] = budgets(tasks, compute, cfg["budgets"])
    print("compute per step, 1 worker: " + ", ".join(f"{t} {1e3 * c:.0f} ms (budget {cfg['budgets'][t]:g} s a run)"
                                                     for t, c in compute.items()), file=sys.stderr, flush=True)
    sweep_plan = plan.sweep_runs(tasks, cfg["setups"], cfg["sweep"], steps=args.sweep_steps, cap_s=args.sweep_cap)
    runs = plan.main_runs(tasks, cfg["setups"], cfg["links"], lrs={}, budgets=cfg["budgets"], fast=fast)
    est = (plan.estimate_s(sweep_plan) if sweep_plan else 0.0) + plan.estimate_s(runs, args.repeats)
    print(f"plan: {len(sweep_plan)} sweep runs, {len(runs)} runs x {args.repeats} repeats on "
          f"{', '.join(cfg['links'])}; estimated {est / 60:.0f} min on an idle 2-core machine", file=sys.stderr)
    if args.dry_run:  # with the lrs the runs will take (a sweep's own are known only once it has run)
        stored = {} if sweep_plan or args.smoke else plan.stored_choice()
        shown = plan.main_runs(tasks, cfg["setups"], cfg["links"], budgets=cfg["budgets"], fast=fast,
                               lrs=plan.inherit_lrs({k: v["lr"] for k, v in stored.items()}))
        for r in sweep_plan + shown:
            print(r.title)
        return 0
    os.makedirs(args.out, exist_ok=True)
    sweep_records: list[dict[str, Any]] = []
    if sweep_plan:
        chosen, sweep_records = run_sweep(tasks, cfg["setups"], cfg["sweep"], args, higher)
        lr_source = f"swept in this run ({args.sweep_steps} steps, multipliers {args.sweep})"
    else:
        chosen = plan.stored_choice() if not args.smoke else {}
        lr_source = "the committed sweep, " + plan.LRS_PATH.split("phalanx/")[-1] if chosen else "base lrs"
    lrs = plan.inherit_lrs({k: v["lr"] for k, v in chosen.items()})
    runs = plan.main_runs(tasks, cfg["setups"], cfg["links"], lrs=lrs, budgets=cfg["budgets"], fast=fast)
    payload = {"command": "python -m benchmarks.quality " + " ".join(shlex.quote(a) for a in argv),
               "started": started.isoformat(timespec="seconds"),
               "environment": {**environment(cfg["links"]), "loadavg": os.getloadavg()},
               "tasks": {t: {"target": cfg["targets"][t], "budget_s": cfg["budgets"][t], "why": get(t).why,
                             "quality": get(t).quality_name, "higher_is_better": higher[t],
                             "per_worker": get(t).per_worker, "compute_s_per_step": compute[t]} for t in tasks},
               "setups": {s: {"provider": SETUPS[s].provider, "note": SETUPS[s].note} for s in cfg["setups"]},
               "skipped_peers": peer_reasons(), "estimate_s": est, "lr_source": lr_source,
               "lr_sweep": [{"task": k[0], "setup": k[1], **v} for k, v in chosen.items()],
               "raw": [], "raw_sweep": sweep_records}
    total = len(runs) * args.repeats

    def partial(records: list[dict[str, Any]]) -> None:
        # every run: the raw records; every 8 runs: the tables (milliseconds); after the last run, main() measures
        # the compute step again and writes the full report with the plots
        payload.update(raw=records, finished=None if len(records) < total else
                       datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))
        if len(records) % 8 == 0 and len(records) < total:
            analyse(payload, args.out, quiet=True, plots=False)
        else:
            write_json(os.path.join(args.out, "quality.json"), payload)

    progress = _Progress(total, est, args.no_progress, partial)
    by_link = {link: [r for r in runs if r.link == link] for link in cfg["links"]}
    try:
        with terminate_unwinds(), links_for(runs) as built:
            for link, mine in by_link.items():
                sessions.run_session(_items(mine, args.repeats, args.evals), built.get(link),
                                     timeout=args.timeout, on_record=progress)
    except KeyboardInterrupt:  # stopped late: the tables of what finished, then stop
        if progress.records:
            payload["stopped"] = f"after {len(progress.records)} of {total} runs"
            analyse(payload, args.out, quiet=True)
            print(f"stopped: the report of {len(progress.records)} of {total} runs is in {args.out}",
                  file=sys.stderr)
        raise
    # The bound scales with the compute step, and one measurement at the start moved by 5-15% between invocations
    # of the same hour while the runs kept their speed: measure it again at the end, the bound takes the mean.
    for t in tasks:
        end = compute_seconds(t, steps=2 if args.smoke else 12)
        payload["tasks"][t].update(compute_s_start=compute[t], compute_s_end=end,
                                   compute_s_per_step=(compute[t] + end) / 2)
    analyse(payload, args.out)
    failed = sum(1 for r in progress.records if r["error"])
    if failed:
        print(f"python -m benchmarks.quality: {failed} run(s) failed; see the tables", file=sys.stderr)
    return 1 if failed else 0


def analyse(payload: dict[str, Any], out: str, quiet: bool = False, plots: bool = True) -> None:
    """Rows, headline, targets, advisor, plots and the report from the raw records; writes everything to ``out``.

    ``--from-json`` calls this on a stored run with other targets: the curves hold every evaluation.
    """
    tasks = payload["tasks"]
    tgt = {t: v["target"] for t, v in tasks.items()}
    higher = {t: v["higher_is_better"] for t, v in tasks.items()}
    # compute-only runs measure the bound's step; they are no setup to compare (each worker trains alone)
    rows = curves.rows([r for r in payload["raw"] if r["run"]["setup"] != curves.COMPUTE_ONLY], tgt, higher)
    side_by_side = curves.side_by_side_steps(payload["raw"])
    compute = {t: side_by_side.get(t, v["compute_s_per_step"]) for t, v in tasks.items()}
    bounds = curves.add_bounds(rows, compute)
    for t, b in bounds.items():
        b["compute_source"] = "side by side" if t in side_by_side else "alone"
    payload.update(rows=rows, bounds=bounds, headline=report.headline(rows), targets=targets.check(rows, bounds),
                   advisor=advisor.check(rows, compute, {t: v["per_worker"] for t, v in tasks.items()}))
    os.makedirs(out, exist_ok=True)
    links = list(dict.fromkeys(r["link"] for r in rows))
    # plots cost seconds of CPU: while runs go on they would steal it from the run in flight, so partial
    # reports (plots=False) have tables only
    pngs = [p for t in tasks for link in links if plots and (p := report.plot(rows, t, link, tasks[t]["quality"], out))]
    write_json(os.path.join(out, "quality.json"), payload)
    md = render(payload, [os.path.basename(p) for p in pngs])
    with open(os.path.join(out, "quality.md"), "w") as f:
        f.write(md)
    if not quiet:
        print(md)


def merged(payloads: list[dict[str, Any]]) -> dict[str, Any]:
    """Several stored runs as one: their records side by side, a task's compute step the mean of its runs'.

    Runs of one task on different links, or with different setups, then share one compute-only bound and one
    advisor table (each run measured its own compute step when it started, to set its budget).
    """
    if len(payloads) == 1:
        return payloads[0]
    out = {**payloads[0], "raw": [r for p in payloads for r in p["raw"]],
           "command": " ; ".join(p["command"] for p in payloads),
           "setups": {k: v for p in payloads for k, v in p["setups"].items()},
           "skipped_peers": {k: v for p in payloads for k, v in p["skipped_peers"].items()}}
    out["environment"] = {**payloads[0]["environment"],
                          "loadavg": [max(p["environment"]["loadavg"][i] for p in payloads) for i in range(3)]}
    tasks: dict[str, Any] = {}
    for p in payloads:
        for t, v in p["tasks"].items():
            tasks.setdefault(t, {**v, "compute_s_runs": []})["compute_s_runs"].append(v["compute_s_per_step"])
    for v in tasks.values():
        v["compute_s_per_step"] = sum(v["compute_s_runs"]) / len(v["compute_s_runs"])
        if len(v["compute_s_runs"]) > 1:  # one invocation's start and end would not be the merged bound's
            v.pop("compute_s_start", None), v.pop("compute_s_end", None)
    out["tasks"] = tasks
    return out


def reanalyse(path: str, target_text: str, out: str) -> int:
    """``--from-json PATH[,PATH...]``: the report of stored runs again (merged: :func:`merged`), with ``--targets``
    applied; nothing is rerun."""
    import json

    payloads = []
    for one in split_list(path):
        try:
            with open(one) as f:
                payloads.append(json.load(f))
        except (OSError, ValueError) as err:
            what = f"--from-json {one!r} ({type(err).__name__}: {err})"
            raise ConfigError(usage(what, "the quality.json a run wrote",
                                    "Pass OUT/quality.json of an earlier run.")) from None
        if not isinstance(payloads[-1], dict) or "raw" not in payloads[-1] or "tasks" not in payloads[-1]:
            raise ConfigError(usage(f"--from-json {one!r}", "the quality.json a run wrote (with 'tasks' and 'raw')",
                                    "Pass OUT/quality.json of an earlier run."))
    payload = merged(payloads)
    for t, v in payload["tasks"].items():  # written before these were stored
        v.setdefault("higher_is_better", get(t).higher_is_better)
        v.setdefault("per_worker", get(t).per_worker)
    for part in split_list(target_text):
        name, _, value = part.partition("=")
        if name not in payload["tasks"]:
            raise ConfigError(usage(f"--targets {part!r}", "TASK=VALUE for a task in " + path, "E.g. gpt=2.6."))
        payload["tasks"][name]["target"] = _floats(value, "targets")[0]
    payload["reanalysed"] = {"from": path, "targets": target_text}
    analyse(payload, out)
    return 0


def _describe(record: dict[str, Any]) -> str:
    r0 = record["ranks"][0]
    return f"{r0['steps']} steps in {r0['train_seconds']:.1f} s, final quality {r0['final']:.3f}"


def render(payload: dict[str, Any], pngs: list[str]) -> str:
    env = payload["environment"]
    parts = [f"# Time to quality on slow links: {payload['started']}\n\n", f"Command: `{payload['command']}`\n\n",
             f"Machine: {env['cpu']}, {env['cpu_count']} cores, torch {env['torch']}; load average at the end "
             f"{tuple(round(x, 2) for x in payload['environment']['loadavg'])}. 2 workers × 1 thread.\n\n",
             "| task | quality | target | budget per run (s) | compute per step, 1 worker (ms) | why this target |\n"
             "|---|---|---|---|---|---|\n"]
    parts += [f"| {t} | {v['quality']} | {v['target']:g} | {v['budget_s']:g} | {1e3 * v['compute_s_per_step']:.0f}"
              + (f" (mean of {1e3 * v['compute_s_start']:.0f} at the start, {1e3 * v['compute_s_end']:.0f} at the end)"
                 if "compute_s_end" in v else "") + f" | {v['why']} |\n" for t, v in payload["tasks"].items()]
    parts += ["\n## Headline (time to target, best phalanx setup)\n\n", report.headline_table(payload["headline"])]
    parts += ["\n## Targets\n\n", targets.markdown(payload["targets"])]
    rows = payload["rows"]
    for task, link in dict.fromkeys((r["task"], r["link"]) for r in rows):
        parts += [f"\n## {task}, {link}\n\n", report.bound_line(payload.get("bounds", {}).get(task)),
                  report.table(rows, task, link)]
    parts += ["\nTimes are training seconds (evaluation excluded), median over repeats (min–max); a repeat that "
              "missed the target counts as infinitely slow. Bytes: what one worker put into collectives "
              "(counted) and what its veth sent (tx_bytes, headers included).\n",
              "\n## The advisor: `phalanx bench`'s projection against these measurements\n\n",
              advisor.markdown(payload["advisor"])]
    if payload["lr_sweep"]:
        parts += ["\n## Learning rates (the same sweep for every setup)\n\n| task | setup | chosen lr | tried: final "
                  "quality |\n|---|---|---|---|\n"]
        parts += [f"| {e['task']} | {e['setup']} | {e['lr']:g} | " +  # JSON keys are strings: float() them
                  ", ".join(f"{float(lr):g}: {q:.3f}" for lr, q in e["tried"].items()) + " |\n"
                  for e in payload["lr_sweep"]]
    parts += ["\n## Peers left out\n\n"] + [f"* {k}: {v}\n" for k, v in payload["skipped_peers"].items()]
    if pngs:
        parts += ["\n## Plots\n\n"] + [f"![{p}]({p})\n" for p in pngs]
    return "".join(parts)


if __name__ == "__main__":
    sys.exit(main())
