"""The chaos soak: SIGKILL a worker of an elastic job at random and inside chosen phases, for K kills; report.

    python benchmarks/chaos.py --out results/chaos                      # base: T = 15 s, K = 40
    python benchmarks/chaos.py --out results/chaos --spares 1           # a parked spare fills each hole first
    python benchmarks/chaos.py --out results/chaos --shard 2            # px.FullyShard(group_size=2) on 4 workers,
                                                                        # State(checkpoint=DIR): every commit on disk
    python benchmarks/chaos.py --out results/chaos --diloco             # px.DiLoCo, a period well under T/3
    python benchmarks/chaos.py --out results/chaos --period 2 --kills 20   # kills faster than a regroup
    python benchmarks/chaos.py --out /tmp/c --kills 6 --period 5        # a short look while developing
    python benchmarks/chaos.py --out /tmp/c --plan join --kills 1       # one kill, aimed at a join
    python benchmarks/chaos.py --out results/chaos-ray --ray --period 30  # phalanx.raytrain, actors killed

It runs ``phalanx run -n 3 --elastic --min-workers 1 --replace tests/workers/chaos_job.py``: the
benchmark's small GPT (``phalanx.bench.models.gpt``, about 1.8M parameters, a checkpoint of about
22 MB: weights and AdamW's moments), AdamW, ``px.elastic.State`` committing every 4 steps and a
``px.save_checkpoint`` every 3 commits. The harness (``tests/support/chaos.py``, shared with the
short form in ``make test``, ``tests/elastic/test_chaos_short.py``) kills a live worker, never the last
one, on average every ``--period`` seconds; ``--aim`` kills per phase (commit, checkpoint write,
regroup, join) are placed by the job's own markers instead (its event lines and the launcher's
store): it waits for a worker to enter that phase and kills at once (a checkpoint: once its files are
being written, phalanx's own ``<path>.tmp-*``; a commit, which takes milliseconds: every worker waits
after its ``commit+`` marker for the harness's word, ``--hold``, and the victim is killed there).
Where each kill landed is read back from the victim's own event file. The job is asked to stop after
a whole epoch once the kills are done.

It reports (OUT/chaos.json, and a short table): kills survived and where they landed, the job's
exit, every sample trained exactly once per epoch (the record each worker keeps, rolled back with
the commits), the final model against one process replayed on that record (AllReduce variants),
the longest time without a step after a kill and overall, and RSS and open descriptors of every
process sampled every second (peak RSS of each long-lived process in the last quarter of its life
over the first, descriptors' change). A job with no step for ``--stall`` seconds is declared
wedged: every process dumps its stacks (faulthandler, SIGUSR2) into the report, and it is stopped.

Targets (issue 36): T = 15 s, K >= 40, >= 3 kills inside each phase; exit 0, exactly once, oracle
within 1e-5, no stretch without a step longer than 30 s, RSS <= 1.1x, descriptors <= +10. With
``--period 2`` the job must go on or end with one line, never wedge (the report says which).

``--ray`` runs the same job through ``phalanx.launch.raytrain.train`` on 3 Ray Train workers
(``tests/workers/chaos_ray.py``: a one-node Ray cluster started here, min_workers=1, no limit on
the failures Ray replaces) and kills the worker actors' processes the same way; Ray replaces each.
The report's ``replacement_start_s`` is how long after a kill the replacement's script started
(for Ray: Ray's own replacement time); run it with ``--period`` at twice that.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import time
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))  # the harness core and the job live with the tests (see there why)
sys.path.insert(0, os.path.join(ROOT, "src"))

from support import chaos  # noqa: E402

TARGETS = {"exit": 0, "oracle": 1e-5, "no_step_s": 30.0, "rss_ratio": 1.1, "fds_delta": 10, "per_phase": 3}


def make_plan(kills: int, aim: int, rng: random.Random, only: list[str] | None = None) -> list[str]:
    """``kills`` kills: ``aim`` aimed at each phase, the rest at random; regroup and join never first.

    Example:
        >>> make_plan(6, 1, random.Random(0)).count("random")
        2
    """
    if only:
        return (only * kills)[:kills]
    aimed = [p for p in chaos.PHASES for _ in range(aim)]
    plan = ["random"] * max(0, kills - len(aimed)) + aimed[:kills]
    rng.shuffle(plan)
    while plan and plan[0] in ("regroup", "join"):  # they follow a kill: there is none before the first
        plan.append(plan.pop(0))
    return plan


def verdict(r: dict, period_s: float) -> dict:
    """Each target: met or not (None where it does not apply)."""
    res = r["resources"]
    launcher = res.get("launcher") or {}
    long = res["long_lived"]
    out = {"exit 0": r["exit"] == 0, "exactly once": r["exactly_once"],
           "oracle <= 1e-5": None if r["oracle_max_abs"] is None else r["oracle_max_abs"] <= TARGETS["oracle"],
           "no step gap > 30 s": r["longest_no_step_s"] <= TARGETS["no_step_s"],
           f">= {TARGETS['per_phase']} kills in each phase": all(r["landed"][p] >= TARGETS["per_phase"]
                                                               for p in chaos.PHASES),
           # over the processes that lived 2 minutes or more (a worker killed sooner shows its warm-up, not growth)
           "RSS <= 1.1x (processes sampled >= 2 min)": None if long["worst_rss_ratio"] is None
           else long["worst_rss_ratio"] <= TARGETS["rss_ratio"],
           "descriptors <= +10 (processes sampled >= 2 min)": None if long["worst_fds_delta"] is None
           else long["worst_fds_delta"] <= TARGETS["fds_delta"],
           "launcher RSS <= 1.1x": launcher.get("rss_ratio", 0) <= TARGETS["rss_ratio"] if launcher else None,
           "launcher descriptors <= +10": launcher.get("fds_delta", 0) <= TARGETS["fds_delta"] if launcher else None}
    if period_s <= 2:  # kills faster than a regroup: going on or one line at the end are both fine, a wedge is not
        lines = [x for x in r["launcher_tail"].splitlines() if x.startswith("phalanx:")]
        out["fast kills: went on or ended with one line"] = not r["outcome"].startswith("wedged")
        r["fast_kills"] = ("went on" if r["exit"] == 0 else
                           f"ended: {lines[-1] if lines else '(no line)'}" if not r["outcome"].startswith("wedged")
                           else r["outcome"])
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="folder for the job's files and chaos.json")
    p.add_argument("--period", type=float, default=15.0, help="T: seconds between kills on average (default 15)")
    p.add_argument("--kills", type=int, default=40, help="K: kills in all (default 40)")
    p.add_argument("--aim", type=int, default=3, help="kills aimed at each phase (default 3)")
    p.add_argument("--plan", default=None,
                   help="comma-separated phases to aim every kill at, in turn (random, step, commit, ckpt, regroup, "
                        "regroup-arrived, join); default: --aim of each, the rest random")
    p.add_argument("--spares", type=int, default=0, help="--spares K on the launcher")
    p.add_argument("--shard", type=int, default=0,
                   help="shard=px.FullyShard(group_size=S), on 4 workers, with State(checkpoint=DIR): 3 workers are "
                        "1 x 3 (one replica group), where a second loss before the replacement joins takes a shard "
                        "that only the disk holds (ShardLostError without it)")
    p.add_argument("--diloco", action="store_true", help="px.DiLoCo(every=--diloco-every)")
    p.add_argument("--diloco-every", type=int, default=8)
    p.add_argument("--ray", action="store_true",
                   help="phalanx.raytrain: the job on 3 Ray Train workers, their actors' processes killed")
    p.add_argument("--size", default="small", choices=("small", "tiny"), help="the GPT (default small)")
    p.add_argument("--commit-every", type=int, default=4)
    p.add_argument("--ckpt-every", type=int, default=3, help="a px.save_checkpoint every this many commits")
    p.add_argument("--state-checkpoint", action="store_true", help="State(checkpoint=DIR) instead: every commit")
    p.add_argument("--hold", default="commit,regroup",
                   help="phases every worker waits in for the harness's word (default commit,regroup: an in-memory "
                        "commit takes milliseconds and a regroup well under a second on an idle machine, too short "
                        "to hit otherwise; a worker not aimed at is released within the harness's next tick); '' "
                        "for none")
    p.add_argument("--heartbeat-timeout", type=float, default=None, help="the launcher's (default its own, 10 s)")
    p.add_argument("--stall", type=float, default=120.0, help="seconds without a step that count as a wedge")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--digest", action="store_true",
                   help="the job writes a digest of its state after every commit, regroup and join (events); "
                        "benchmarks/chaos_trace.py then finds the first one that leaves the oracle")
    p.add_argument("--oracle", default="now", choices=("now", "later"),
                   help="replay the one-process oracle at the end (now), or leave it to --replay (later: the "
                        "replay of a long soak runs half as long as the soak, and must not run beside another)")
    p.add_argument("--replay", action="store_true",
                   help="only the deferred oracle of the soak in --out: replay it, then write chaos.json again")
    a = p.parse_args(argv)
    if a.replay:
        return replay(a.out)
    if a.ray and (a.spares or a.shard):
        p.error("--ray runs the base job (3 workers, AllReduce or --diloco); --spares and --shard are not wired to it")
    if a.period <= 0 or a.kills < 0 or a.aim < 0:
        p.error(f"got --period {a.period} --kills {a.kills} --aim {a.aim}; expected a period > 0 and counts >= 0 "
                "(--kills 0: a run without kills)")
    a.state_checkpoint = a.state_checkpoint or bool(a.shard)  # the R = 1 safety net (see --shard)
    a.out = os.path.abspath(a.out)  # the workers' own working directory may differ (Ray Train sets its own)
    os.makedirs(a.out, exist_ok=True)
    n = 4 if a.shard else 3
    run_flags = ["-n", str(n), "--elastic", "--min-workers", "1", "--replace"]
    run_flags += ["--spares", str(a.spares)] if a.spares else []
    run_flags += ["--heartbeat-timeout", f"{a.heartbeat_timeout:g}"] if a.heartbeat_timeout else []
    if a.ray:  # tests/workers/chaos_ray.py: Ray Train starts 3 workers and replaces each one lost (min_workers=1)
        run_flags = ["--workers", "3"] + (["--heartbeat-timeout", f"{a.heartbeat_timeout:g}"]
                                          if a.heartbeat_timeout else [])
    commit_every = a.diloco_every if a.diloco else a.commit_every  # DiLoCo commits only where replicas agree
    job = ["--size", a.size, "--commit-every", str(commit_every), "--ckpt-every", str(a.ckpt_every)]
    job += ["--strategy", "diloco", "--diloco-every", str(a.diloco_every)] if a.diloco else []
    job += ["--shard", str(a.shard)] if a.shard else []
    job += ["--state-checkpoint"] if a.state_checkpoint else []
    job += ["--hold", a.hold] if a.hold else []
    job += ["--digest"] if a.digest else []
    plan = make_plan(a.kills, a.aim, random.Random(a.seed), a.plan.split(",") if a.plan else None)
    soak = chaos.Soak(a.out, run_flags, job, plan, period_s=a.period, stall_s=a.stall, seed=a.seed,
                      commit_every=commit_every,
                      save_every=0 if a.state_checkpoint else commit_every * a.ckpt_every, ray=a.ray,
                      replay=a.oracle == "now")
    report = soak.run()
    report["period_s"] = a.period
    report["command"] = " ".join(["python", "benchmarks/chaos.py", *(argv if argv is not None else sys.argv[1:])])
    report["job"] = {"run": run_flags, "script": job, "plan": plan}
    return write_report(a.out, report)


def replay(out: str) -> int:
    """The deferred oracle of the soak in ``out`` (``--oracle later``), then its report again."""
    with open(os.path.join(out, "chaos.json")) as f:
        report = json.load(f)
    final = os.path.join(out, "final.pt")
    if not report.get("oracle_deferred") or not os.path.exists(final):
        print(f"{out}: no deferred oracle to replay (the soak ran with --oracle now, or wrote no final.pt)")
        return 2
    started = time.monotonic()
    report["oracle_max_abs"] = chaos.replay_oracle(final)
    report["oracle_deferred"] = False
    report["oracle_replay_s"] = round(time.monotonic() - started, 1)
    return write_report(out, report)


def write_report(out: str, report: dict) -> int:
    """Judge ``report`` against the targets, write ``out/chaos.json``, print it; 0 when every target is met."""
    report["targets"] = verdict(report, report["period_s"])
    with open(os.path.join(out, "chaos.json"), "w") as f:
        json.dump(report, f, indent=1, default=str)
    print(chaos.table(report))
    for name, ok in report["targets"].items():
        print(f"  target {name}: {'-' if ok is None else 'met' if ok else 'NOT MET'}")
    if report.get("fast_kills"):
        print(f"  kills faster than a regroup: {report['fast_kills']}")
    for e in report["errors"]:
        late = " (after the harness stopped the job)" if e["after_the_harness_stopped_the_job"] else ""
        print(f"  worker {e['id']} raised {e['type']}{late}: {e['message'][:300]}")
    print(f"wrote {os.path.join(out, 'chaos.json')}")
    return 0 if all(ok is not False for ok in report["targets"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
