"""Elastic training: the cost of ``--elastic`` with no failure, recovery time, steps redone.

    python benchmarks/elastic.py --out results/elastic                      # (a), (b), (c)
    python benchmarks/elastic.py --out results/elastic --parts overhead     # (a) alone, 2 min 11 s idle

(a) Step time of ResNet-20 (CIFAR shapes, batch 32 per worker, synthetic data), 2 workers,
    each setup in fresh processes, ``--repeats`` interleaved runs (the order alternates), each
    run's mean step time after 5 warm-up steps; ratios are taken run by run against ``ddp`` of
    the same repeat. The setups (``--setups``) break the cost of ``--elastic`` down:
    ``ddp`` (plain ``phalanx run -n 2``: DDP's reducer), ``hooks`` (plain ``phalanx run``, AllReduce
    through the overlapped per-parameter hooks that ``--elastic`` uses), ``elastic`` (``phalanx
    run -n 2 --elastic``, commits every 10 steps, heartbeats, the elastic launcher) and, on
    request, ``elastic-no-commit`` (the same without commits). Beside wall time it prints each
    worker's CPU time per step and the launcher's (which a loaded machine inflates less), the
    hooks' exposed wait, and one commit's time.
(b) Time from a kill -9 to the first step of the rebuilt group, one host, 3 workers
    (tests/workers/elastic.py, a small MLP, 50 ms per step), the worker started as rank 1
    killed at step 15, commits every 10: shrink (the survivors go on with 2), ``--replace``
    (a new process joins at a later commit) and ``--spares 1`` (a parked spare enters at the
    regroup). "back to 3" is the time until the group is at 3 workers again.
(c) Work lost per failure: the steps redone after the rollback.

It prints tables (median and min-max) and writes them as JSON to OUT/elastic.json; with
``--profile``, cProfile files of both workers of the first repeat of each setup go to OUT.
About 6 minutes on an idle 2-core machine with the defaults.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(ROOT, "tests", "workers", "elastic.py")
CLI = [sys.executable, "-c", "import sys; from phalanx.cli import main; sys.exit(main())"]
MODES = {"shrink": [], "--replace": ["--replace"], "--spares 1": ["--spares", "1"]}
WARMUP = 5


# -- (a) the worker: ResNet-20 under `phalanx run -n 2 [--elastic] benchmarks/elastic.py --worker` -------
# The setups of the breakdown, each in fresh processes: what the launch adds, and what the gradient path adds.
SETUPS = {
    "ddp": "`phalanx run -n 2`: AllReduce through DDP's reducer (the default)",
    "hooks": "`phalanx run -n 2`: AllReduce through the overlapped hooks (the --elastic path), no --elastic",
    "elastic-no-commit": "`phalanx run -n 2 --elastic`, commit_every=None (only the commit at the start)",
    "elastic": "`phalanx run -n 2 --elastic`, commits every 10 steps",
}


def worker(out: str, steps: int, setup: str, profile: bool) -> None:
    import torch
    import torch.nn.functional as F

    import phalanx as px
    from phalanx.bench.models import resnet_cifar

    class HookedAllReduce(px.AllReduce):
        """AllReduce on the path --elastic takes (per-parameter hooks, no DDP), without --elastic."""

        def attach(self, model, optimizer, *, wrapper=True):  # noqa: ANN001, ANN201
            return super().attach(model, optimizer, wrapper=False)

    px.init()
    torch.manual_seed(0)
    net = resnet_cifar(20)
    strategy = HookedAllReduce() if setup == "hooks" else px.AllReduce()
    model, opt = px.wrap(net, torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9), strategy=strategy)
    n = 32 * px.world_size() * (steps + WARMUP)
    data = torch.utils.data.TensorDataset(torch.randn(n, 3, 32, 32), torch.randint(0, 10, (n,)))
    loader = px.shard(data, batch_size=32, seed=0)
    state = px.elastic.State(model, opt, loader, commit_every=None if setup == "elastic-no-commit" else 10)
    times: list[float] = []
    cpu: list[float] = []  # this process's CPU time (every thread) at the end of each step
    launcher: list[float] = []  # the launcher's (our parent's): it shares the cores with the workers
    waited: list[float] = []  # the strategy's exposed communication so far (the hooks' final wait; DDP: none)
    commits: list[float] = []  # each commit's own time (inside opt.step(), so in the step time too)
    comm = px.strategy_of(opt).comm
    commit = state.commit

    def timed_commit() -> None:
        started = time.perf_counter()
        commit()
        commits.append(time.perf_counter() - started)

    state.commit = timed_commit  # type: ignore[method-assign]

    @px.elastic.run
    def train(state: px.elastic.State) -> None:
        for x, y in loader:
            started = time.perf_counter()
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
            times.append(time.perf_counter() - started)
            cpu.append(time.process_time())
            launcher.append(parent_cpu_s())
            waited.append(comm.stats.seconds)

    profiler = None
    if profile:
        import cProfile
        profiler = cProfile.Profile()
        profiler.enable()
    train(state)
    if profiler is not None:
        profiler.disable()
        profiler.dump_stats(os.path.join(out, f"profile{px.rank()}.pstats"))
    timed = times[WARMUP:]
    with open(os.path.join(out, f"resnet{px.rank()}.json"), "w") as f:
        # step_s: the mean over the timed steps; cpu_s: CPU per step, all threads of the process, over the
        # same steps (a second worker or another user on the same cores cannot inflate it as it does wall time)
        json.dump({"step_s": sum(timed) / len(timed), "steps": len(timed),
                   "cpu_s": (cpu[-1] - cpu[WARMUP - 1]) / (len(cpu) - WARMUP),
                   "launcher_cpu_s": (launcher[-1] - launcher[WARMUP - 1]) / (len(cpu) - WARMUP),
                   "wait_s": (waited[-1] - waited[WARMUP - 1]) / (len(cpu) - WARMUP),
                   "commit_s": statistics.median(commits[1:]) if len(commits) > 1 else None}, f)


def parent_cpu_s() -> float:
    """The parent process's CPU time (user + system), from /proc (Linux); 0 where there is none."""
    try:
        with open(f"/proc/{os.getppid()}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return 0.0


def resnet_step(setup: str, steps: int, profile_to: str | None = None) -> dict:
    """One run of ``setup`` in fresh processes: rank 0's wall and both workers' CPU per step, the launcher's CPU."""
    with tempfile.TemporaryDirectory() as out:
        flags = ["--elastic", "--min-workers", "1"] if setup.startswith("elastic") else []
        subprocess.run([*CLI, "run", "-n", "2", *flags, __file__, "--worker", "--out", out, "--steps", str(steps),
                        "--setup", setup, *(["--profile"] if profile_to else [])],
                       check=True, capture_output=True, text=True, timeout=600)
        ranks = [json.load(open(os.path.join(out, f"resnet{r}.json"))) for r in range(2)]
        if profile_to:
            os.makedirs(profile_to, exist_ok=True)
            for f in glob.glob(os.path.join(out, "profile*.pstats")):
                shutil.copy(f, os.path.join(profile_to, f"{setup}-{os.path.basename(f)}"))
        return {"step_s": ranks[0]["step_s"], "cpu_s": sum(r["cpu_s"] for r in ranks) / 2,
                "launcher_cpu_s": ranks[0]["launcher_cpu_s"], "wait_s": ranks[0]["wait_s"],
                "commit_s": ranks[0]["commit_s"]}


# -- (b), (c): kill the worker started as rank 1 at step 15 --------------------------------------
def recovery(flags: list[str]) -> dict:
    with tempfile.TemporaryDirectory() as out:
        proc = subprocess.run([*CLI, "run", "-n", "3", "--elastic", "--min-workers", "2", *flags, WORKER,
                               "--out", out, "--epochs", "20", "--commit-every", "10", "--kill", "1@15",
                               "--step-sleep", "0.05"], capture_output=True, text=True, timeout=600)
        if proc.returncode != 0:
            raise SystemExit(f"elastic run {flags} failed:\n{proc.stderr[-2000:]}")
        killed = json.load(open(os.path.join(out, "killed.json")))["time"]
        main = json.load(open(os.path.join(out, "worker0.json")))
        full = [t for t, world, _ in main["changes"] if world == 3]
        return {"kill_to_first_step_s": main["changes"][0][0] - killed,
                "kill_to_back_to_3_s": full[0] - killed if full else None,
                "redone_steps": main["history"][0]["redone_steps"],
                "processes_started_after_kill": sum(os.path.getmtime(f) > killed
                                                    for f in glob.glob(os.path.join(out, "start*.json")))}


def summary(values: list) -> dict | None:
    values = [v for v in values if v is not None]
    if not values:
        return None
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def cell(s: dict | None, scale: float = 1.0, fmt: str = "{:.2f}") -> str:
    if s is None:
        return "-"
    return f"{fmt.format(s['median'] * scale)} ({fmt.format(s['min'] * scale)}-{fmt.format(s['max'] * scale)})"


def overhead(trials: int, steps: int, setups: list[str], profile_to: str | None) -> dict:
    """(a): every setup once per trial, interleaved (the order alternates), ratios to ``ddp`` of the same trial."""
    runs: dict[str, list[dict]] = {s: [] for s in setups}
    for t in range(trials):  # interleaved, so that drift on the machine hits every setup alike
        for s in (setups if t % 2 == 0 else setups[::-1]):
            runs[s].append(resnet_step(s, steps, profile_to if t == 0 else None))
    base = setups[0]
    out: dict = {"setups": {s: SETUPS[s] for s in setups}, "steps": steps, "trials": trials, "baseline": base}
    for s, rs in runs.items():
        out[s] = {"step_s": summary([r["step_s"] for r in rs]), "cpu_s": summary([r["cpu_s"] for r in rs]),
                  "launcher_cpu_s": summary([r["launcher_cpu_s"] for r in rs]),
                  "wait_s": summary([r["wait_s"] for r in rs]), "commit_s": summary([r["commit_s"] for r in rs]),
                  "wall_ratio": summary([r["step_s"] / b["step_s"] for r, b in zip(rs, runs[base], strict=True)]),
                  "cpu_ratio": summary([r["cpu_s"] / b["cpu_s"] for r, b in zip(rs, runs[base], strict=True)]),
                  "raw": rs}
    print(f"(a) ResNet-20, 2 workers, per step: median (min-max) of {trials} interleaved runs of {steps} steps; "
          f"ratios to {base} in the same run")
    head = ["setup", "wall ms", "wall ratio", "CPU ms/worker", "CPU ratio", "launcher CPU ms", "comm wait ms",
            "commit ms"]
    rows = [[s, cell(r["step_s"], 1e3, "{:.1f}"), cell(r["wall_ratio"], 1.0, "{:.3f}"),
             cell(r["cpu_s"], 1e3, "{:.1f}"), cell(r["cpu_ratio"], 1.0, "{:.3f}"),
             cell(r["launcher_cpu_s"], 1e3, "{:.2f}"), cell(r["wait_s"], 1e3, "{:.1f}"),
             cell(r["commit_s"], 1e3, "{:.2f}")] for s, r in ((s, out[s]) for s in setups)]
    widths = [max(len(x[i]) for x in [head, *rows]) for i in range(len(head))]
    for row in [head, *rows]:
        print("    " + "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)))
    print("    CPU: all threads of a worker, per step; launcher CPU: the launcher's per step (it shares the cores); "
          "comm wait: the hooks' exposed wait at the end of backward (DDP waits inside its reducer: not counted); "
          "commit: one in-memory commit, every 10 steps")
    for s in setups:
        print(f"    {s}: {SETUPS[s]}")
    return out


def recoveries(trials: int) -> dict:
    """(b), (c): kill one of 3 workers, for every mode."""
    runs: dict[str, list[dict]] = {m: [] for m in MODES}
    for _ in range(trials):
        for mode, flags in MODES.items():
            runs[mode].append(recovery(flags))
    result = {mode: {k: summary([r[k] for r in rs]) for k in rs[0]} | {"raw": rs} for mode, rs in runs.items()}
    print(f"(b, c) kill -9 of 1 of 3 workers at step 15, commits every 10; seconds, median (min-max) of {trials}")
    print(f"    {'mode':<12} {'kill -> first step':<22} {'kill -> back to 3':<22} {'steps redone':<14} new processes")
    for mode in runs:
        row = result[mode]
        print(f"    {mode:<12} {cell(row['kill_to_first_step_s']):<22} {cell(row['kill_to_back_to_3_s']):<22} "
              f"{cell(row['redone_steps'], 1.0, '{:g}'):<14} {cell(row['processes_started_after_kill'], 1.0, '{:g}')}")
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="folder for elastic.json (or, with --worker, the run's folder)")
    p.add_argument("--parts", default="overhead,recovery",
                   help="comma-separated: overhead (a), recovery (b, c); default both")
    p.add_argument("--repeats", type=int, default=5, help="(a): interleaved runs of every setup")
    p.add_argument("--trials", type=int, default=3, help="(b, c): kills per mode")
    p.add_argument("--steps", type=int, default=40, help="(a): timed ResNet-20 steps per run (after 5 warm-up steps)")
    p.add_argument("--setups", default="ddp,hooks,elastic",
                   help=f"comma-separated, the first is the ratios' baseline; of {', '.join(SETUPS)}")
    p.add_argument("--profile", action="store_true", help="(a): cProfile both workers of the first trial into OUT")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--setup", default="ddp", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.worker:
        return worker(a.out, a.steps, a.setup, a.profile)
    parts = a.parts.split(",")
    setups = a.setups.split(",")
    bad = [x for x in parts if x not in ("overhead", "recovery")] + [x for x in setups if x not in SETUPS]
    if bad or min(a.repeats, a.trials, a.steps) < 1:
        p.error(f"got --parts {a.parts} --setups {a.setups} --repeats {a.repeats} --trials {a.trials} --steps "
                f"{a.steps}; expected parts of overhead,recovery, setups of {','.join(SETUPS)}, and counts >= 1")
    os.makedirs(a.out, exist_ok=True)
    result = {}
    if "overhead" in parts:
        result["step_time_resnet20_2_workers"] = overhead(a.repeats, a.steps, setups,
                                                          a.out if a.profile else None)
    if "recovery" in parts:
        result["recovery_3_workers_kill_at_15_commit_every_10"] = recoveries(a.trials)
    with open(os.path.join(a.out, "elastic.json"), "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {os.path.join(a.out, 'elastic.json')}")


if __name__ == "__main__":
    main()
