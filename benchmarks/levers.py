"""Steps to target of issue 41's levers, 2 workers on loopback, step-counted (the machine's load changes nothing).

    python -m benchmarks.levers --tasks gpt,resnet20,lstm --setups lever-base,lever-h16 --seeds 0,1,2 \\
        --out results/levers

Each run is the quality benchmark's (:mod:`benchmarks.quality.worker`: two real processes, gloo on loopback, the
task's batches, model and lr of ``lrs.json``), counted in steps instead of seconds: it evaluates every
``--eval-every`` steps, every 4 steps once within the task's band of the target, stops once the target is met,
and otherwise runs the task's ``budget_steps``. A rule whose arithmetic does not depend on timing (every rule
here: periods and overlaps are counted in steps) takes the same steps to target on any link, so loopback
measures them for every link. The table gives each setup's steps to target per seed over the one-process
oracle's (``ORACLE``, from ``benchmarks/quality_oracle.py``).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "src"))
sys.path.insert(0, ROOT)

#: The one-process oracle's first evaluated step at the target, per seed 0-2, every 4 steps (python
#: benchmarks/quality_oracle.py --task T --seeds 0,1,2 --every 4, at DDP's lr); 0: not recorded. Where the same
#: file holds DDP's runs (exact gradient averaging: the one-process run's arithmetic), the table uses those.
ORACLE = {"gpt": (112, 104, 100), "resnet20": (0, 0, 0), "lstm": (128, 140, 120)}
#: Within this of the target, evaluate at every check (4 steps): resnet20's own band is off in the timed benchmark.
BANDS = {"gpt": 0.08, "resnet20": 0.05, "lstm": 0.05}


def first_at_target(curve: list, target: float, higher: bool) -> int | None:
    """The first evaluated step whose quality meets the target (curve rows: clock, step, quality).

        >>> first_at_target([[0.0, 0, 3.0], [1.0, 8, 2.7]], 2.75, False)
        8
    """
    return next((int(s) for _, s, q in curve if (q >= target if higher else q <= target)), None)


def main(argv: list[str] | None = None) -> int:
    from benchmarks.quality.plan import QRun, base_lr, inherit_lrs, stored_choice
    from benchmarks.quality.sessions import Item, run_session
    from benchmarks.quality.tasks import get

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tasks", default="gpt,resnet20,lstm")
    p.add_argument("--setups", default="lever-base")
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--eval-every", type=int, default=16)
    p.add_argument("--timeout", type=float, default=900.0)
    p.add_argument("--link", default="loopback", help="loopback, or one rate (root): two namespaces, tc tbf")
    p.add_argument("--project", action="store_true", help="no run: the time-to-target PROJECTION from the steps "
                   "measured here and the decision's step model (project())")
    p.add_argument("--steps", type=int, default=0, help="instead of steps to target: this many steps, evaluated "
                   "only at the end, for the step time and the bytes per step on --link")
    p.add_argument("--out", default="results/levers")
    args = p.parse_args(argv)
    if args.project:
        print(project())
        return 0
    tasks, setups = args.tasks.split(","), args.setups.split(",")
    seeds = [int(s) for s in args.seeds.split(",")]
    lrs = inherit_lrs({k: v["lr"] for k, v in stored_choice().items()})
    items = []
    for task in tasks:
        t = get(task)
        for setup in setups:
            lr = lrs.get((task, setup), base_lr(task, setup))
            steps = args.steps or t.budget_steps
            run = QRun(task, setup, args.link, lr, 1e9, steps, t.per_worker)
            for seed in seeds:
                cfg = {"task": task, "setup": setup, "lr": lr, "budget_s": 1e9, "max_steps": steps,
                       "per_worker": t.per_worker, "threads": 1, "seed": seed, "evals": 1, "check_every": 4}
                if not args.steps:
                    cfg.update(eval_every=args.eval_every, near_band=BANDS[task], stop_at_target=True)
                items.append(Item(run=run, repeat=seed, config=cfg))
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "levers.jsonl")
    started = time.time()

    def record(r: dict) -> None:
        with open(path, "a") as f:
            f.write(json.dumps({**r, "load": os.getloadavg()}) + "\n")
        run, seed = r["run"], r["repeat"]
        res = r["ranks"][0] if r["ranks"] else {}
        t = get(run["task"])
        at = first_at_target(res.get("curve", []), t.target, t.higher_is_better) if res else None
        what = f"error {r['error']}" if r["error"] else (
            f"target at {at}, {res.get('steps')} steps run, {1e3 * res['train_seconds'] / res['steps']:.0f} ms/step, "
            f"{res['bytes_per_step']:.0f} B/step counted, wire {res.get('wire_bytes_per_step')}")
        print(f"[{time.time() - started:6.0f} s] {run['task']} {run['setup']} seed {seed}: {what}, "
              f"load {os.getloadavg()[0]:.1f}", flush=True)

    if args.link == "loopback":
        run_session(items, None, timeout=args.timeout, on_record=record)
    else:
        from phalanx.launch.netns import Link

        with Link(args.link) as link:
            run_session(items, link, timeout=args.timeout, on_record=record)
    print(table(path))
    return 0


def table(path: str) -> str:
    """Markdown: per task and setup, steps to target per seed, over the oracle's, and how many seeds reached it."""
    from benchmarks.quality.tasks import get

    rows: dict[tuple[str, str], dict[int, int | None]] = {}
    with open(path) as f:
        for line in f:
            r = json.loads(line)
            run, res = r["run"], (r["ranks"][0] if r["ranks"] else None)
            t = get(run["task"])
            at = first_at_target(res["curve"], t.target, t.higher_is_better) if res else None
            rows.setdefault((run["task"], run["setup"]), {})[r["repeat"]] = at
    # the reference per seed: DDP's steps measured in this file (the one-process run's arithmetic), else the oracle's
    ref: dict[str, dict[int, int]] = {task: dict(enumerate(steps)) for task, steps in ORACLE.items()}
    for (task, setup), per in rows.items():
        if setup == "ddp":
            ref.setdefault(task, {}).update({s: v for s, v in per.items() if v})
    out = ["| task | setup | steps to target (seeds) | over the oracle's | worst | reached |",
           "|---|---|---|---|---|---|"]
    for (task, setup), per in rows.items():
        ratios = [per[s] / ref[task][s] for s in sorted(per) if per[s] is not None and ref.get(task, {}).get(s)]
        steps = ", ".join("—" if per[s] is None else str(per[s]) for s in sorted(per))
        reached = sum(v is not None for v in per.values())
        med = f"{statistics.median(ratios):.2f}×" if ratios else "—"
        worst = f"{max(ratios):.2f}×" if ratios and reached == len(per) else "not reached" if reached < len(per) \
            else "—"
        out.append(f"| {task} | {setup} | {steps} | {med} | {worst} | {reached}/{len(per)} |")
    return "\n".join(out)


# -- time to target on shaped links: a PROJECTION from the measured steps and the decision's step model ------------
#: Inputs of :func:`project`, each measured where it says. Compute step per worker, idle (ms): the GPT 53 and
#: ResNet-20 67.5 (benchmarks/reports/quality.md, 2026-11-27: 9.5 s / 180 and 13.5 s / 200 steps), the LSTM 140
#: (one process, global batch 32 in 0.28 s at load 3, halved; 2026-11-28). Parameters as counted by torch.
FAMILIES = {"gpt": (0.053, 636_032), "resnet20": (0.0675, 272_474), "lstm": (0.140, 1_052_416)}
#: One worker's time to quantise the gradient to 4 bits (blocks of 256) and back, as px.Auto times it (s; one
#: thread, 2026-11-29, idle): the compressed all-reduce's compute.
QUANTIZE_S = {"gpt": 0.0061, "resnet20": 0.0024, "lstm": 0.0122}
#: The rates the shaped links achieve (bytes/s): 9.36 Mbit/s measured by px.Auto on the 10 Mbit/s link
#: (docs/strategies.md), 93 Mbit/s of 100 (docs GUIDE: 90-94), 1 Gbit/s assumed at 94% like the others.
LINKS = {"1gbit": 0.94e9 / 8, "100mbit": 93e6 / 8, "10mbit": 9.36e6 / 8}
def _sizes(task: str) -> tuple[int, ...]:
    """The task's trainable tensors' values (Streaming DiLoCo's fragments of whole tensors; the LSTM's recurrent
    weights are 76% of it, so its largest fragment is, whatever the fragment count)."""
    from benchmarks.quality.tasks import get

    return tuple(p.numel() for p in get(task).model().parameters() if p.requires_grad)


#: Steps to target per seed measured above (None: missed within the budget), by rule setting.
STEPS = {
    "gpt": {"one-process": (112, 104, 100), "lever-base": (140, 116, 124), "lever-ef": (128,),
            "allreduce-4bit": (112, 104, 108), "lever-h4": (132, 120, 120), "lever-h8": (132, 120, 116),
            "lever-h8-f8v": (136, 120, 120),
            "lever-h16": (136, 124, 120), "lever-h32": (140, 128, 120)},
    "resnet20": {"one-process": (108, 144, 128), "lever-base": (200,), "lever-ef": (196,),
                 "allreduce-4bit": (104, 144, 116), "lever-h4": (144, 160, 112), "lever-h8": (152, 152, 152),
                 "lever-h8-f8v": (152, 164, 140),
                 "lever-h16": (164, 192, 152), "lever-h32": (192, None, 200)},
    "lstm": {"one-process": (128, 140, 120), "lever-base": (160, 168, 148), "lever-ef": (None,),
             "allreduce-4bit": (136, 140, 132), "lever-h4": (144, 160, 160), "lever-h8": (156, 168, 148),
             "lever-h8-f8v": (152, 160, 156),
             "lever-h16": (152, 164, 148), "lever-h32": (160, 164, 148)},
}
#: The steps above each penalty of the decision stands for.
MEASURED_AS = {"allreduce": "one-process", "allreduce-4bit": "allreduce-4bit", "streaming-diloco": "lever-base",
               "streaming-diloco-h4": "lever-h4", "streaming-diloco-h8": "lever-h8",
               "streaming-diloco-h16": "lever-h16", "streaming-diloco-h32": "lever-h32",
               "streaming-diloco-h64": "lever-base",
               "streaming-diloco-sparseloco": "lever-ef"}
#: Each family's inner optimizer, as px.Auto reads it (the penalties of its kind).
INNER = {"gpt": "adaptive", "lstm": "adaptive", "resnet20": "sgd"}


def project() -> str:
    """Markdown: per family and link, time to target over the compute-only bound (PROJECTION), median over the seeds
    measured, with how many reached the target: AllReduce/DDP, Streaming DiLoCo (auto's H = 64 setting), SparseLoCo
    (H = 16), and what ``decide`` picks there (its probe included: 3 AllReduce steps on a fast link; on a slow one 3
    local steps, one average of the drift in 4 bits and the link probe)."""
    import math

    from phalanx.strategies.auto import Auto
    from phalanx.strategies.probe import PROBE_BITS
    from phalanx.strategies.decision import PROBE_BYTES, Measurement, candidates, decide
    from phalanx.strategies.quantize import Quantize

    def ratio(steps: tuple, step_s: float, task: str, compute: float, extra: float = 0.0) -> tuple[float, int]:
        base = STEPS[task]["one-process"]  # ResNet-20: DDP's on loopback, the one-process run's arithmetic
        r = [(s * step_s + extra) / (b * compute) for s, b in zip(steps, base) if s is not None]
        return (sorted(r)[len(r) // 2] if r else math.inf), len(r)

    out = ["| family | link | AllReduce (= DDP's steps) | Streaming DiLoCo H=64 4-bit | SparseLoCo H=16 | auto picks | "
           "auto | auto's bytes/step (x fewer than DDP) |", "|---|---|---|---|---|---|---|---|"]
    for task, (compute, params) in FAMILIES.items():
        for link, rate in LINKS.items():
            m = Measurement(compute, 4 * params, rate, 0.0, 2, _sizes(task), QUANTIZE_S[task], inner=INNER[task])
            cands = candidates(m, 200)
            ar = next(c for c in cands if c.rule == "allreduce")
            sd = next(c for c in cands if c.rule == "streaming-diloco" and c.kwargs["every"] == 64 and
                      c.kwargs["fragments"] == 2 and c.kwargs["quantize"] == 4)
            sp = next(c for c in cands if c.kwargs.get("quantize") == "sparseloco" and c.kwargs["fragments"] == 2)
            cells = {"allreduce": ratio(STEPS[task]["one-process"], ar.step_s, task, compute),
                     "sd": ratio(STEPS[task]["lever-base"], sd.step_s, task, compute),
                     "sp": ratio(STEPS[task]["lever-ef"], sp.step_s, task, compute)}
            pick = decide(m, 200).choice
            steps = STEPS[task][MEASURED_AS[pick.penalty]]
            # the probe: on a slow link (a full all-reduce over Auto.slow_link compute steps) 3 local steps, one
            # average of the drift in 4 bits (an all-gather) and the <= 1 MiB link probe; on a fast one 3 AllReduce
            # steps (the link probe left out)
            slow = m.ring_s(m.grad_bytes) > Auto.slow_link * compute
            average = m.gather_s(Quantize(bits=PROBE_BITS).message_bytes(params))
            probe = 3 * compute + average + m.ring_s(min(m.grad_bytes, PROBE_BYTES)) if slow else 3 * ar.step_s
            auto = ratio(tuple(None if s is None else s - 3 for s in steps), pick.step_s, task, compute, extra=probe)
            seeds = {"allreduce": "one-process", "sd": "lever-base", "sp": "lever-ef"}
            fmt = {k: "not reached" if math.isinf(v) else f"{v:.2f}× ({n}/{len(STEPS[task][seeds[k]])})"
                   for k, (v, n) in cells.items()}
            auto_s = "not reached" if math.isinf(auto[0]) else f"{auto[0]:.2f}× ({auto[1]}/{len(steps)})"
            out.append(f"| {task} | {link} | {fmt['allreduce']} | {fmt['sd']} | {fmt['sp']} | {pick.describe()} | "
                       f"{auto_s} | {pick.bytes_per_step or ar.bytes_per_step:,.0f} "
                       f"({ar.bytes_per_step / (pick.bytes_per_step or ar.bytes_per_step):,.0f}×) |")
    return "\n".join(out)


if __name__ == "__main__":
    sys.exit(main())
