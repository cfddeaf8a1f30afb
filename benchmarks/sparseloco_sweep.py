"""One-process screen of SparseLoCo settings on the quality benchmark's tasks: steps to target, no network.

    python benchmarks/sparseloco_sweep.py --seeds 0,1,2 --steps 180 \\
        --configs "H=16,k=64,decay=0.95" "H=16,k=64,decay=0.999" "H=50,diloco"

Each config trains ``--world`` replicas of the task's model in this one process, each with its own AdamW
(the task's per-worker batch of the benchmark's step and rank, as the benchmark's workers see them), and every
``H`` steps takes DiLoCo's outer step on a shared anchor: with ``k`` given, through ``px.SparseLoCo(topk=k,
chunk=..., decay=...)``'s own encode / sum_messages (each replica its own compressor and residual, as each
worker has) and outer lr ``olr`` with no momentum; with ``diloco``, the plain mean and Nesterov (``olr`` 0.7,
momentum 0.9). Replica 0's weights are evaluated every ``--eval-every`` steps, as the benchmark's rank 0 is.
It screens candidates in a fraction of the benchmark's time; the benchmark (``python -m benchmarks.quality``,
real processes and gloo) confirms the pick. Config keys: H, k, chunk, decay, olr, lr (inner), diloco,
dense (SparseLoCo's error feedback and outer rule with every entry sent in float32: the sparsity's cost).
"""
from __future__ import annotations

import argparse
import copy
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "src"))
sys.path.insert(0, ROOT)


def parse(config: str) -> dict:
    """One ``--configs`` entry as settings (the rest at SparseLoCo's and the benchmark's defaults).

        >>> c = parse("H=8,k=32,lr=0.002"); (c["H"], c["k"], c["decay"], c["olr"], c["lr"])
        (8, 32, 0.95, 1.0, 0.002)
        >>> parse("H=50,diloco")["olr"]
        0.7
    """
    out: dict = {"H": 16, "k": 64, "chunk": 4096, "decay": 0.95, "olr": None, "lr": 0.001, "diloco": False,
                 "dense": False}
    for part in filter(None, config.split(",")):
        key, _, value = part.partition("=")
        if key in ("diloco", "dense"):
            out[key] = True
        elif key in ("H", "k", "chunk"):
            out[key] = int(value)
        else:
            out[key] = float(value)
    if out["olr"] is None:
        out["olr"] = 0.7 if out["diloco"] else 1.0
    return out


def run(task_name: str, cfg: dict, seed: int, steps: int, eval_every: int, world: int) -> list[tuple[int, float]]:
    import torch
    from torch.nn.utils import parameters_to_vector, vector_to_parameters

    import phalanx as px
    from benchmarks.quality.tasks import get

    task = get(task_name)
    torch.manual_seed(seed)
    model = task.model()
    replicas = [copy.deepcopy(model) for _ in range(world)]
    opts = [task.optim.build(m.parameters(), cfg["lr"]) for m in replicas]
    anchor = parameters_to_vector(model.parameters()).detach().clone()
    momentum = torch.zeros_like(anchor)
    comps = [px.SparseLoCo(cfg["k"], chunk=cfg["chunk"], decay=cfg["decay"]) for _ in range(world)]
    residuals = [torch.zeros_like(anchor) for _ in range(world)]
    points = [(0, task.evaluate(replicas[0]))]
    for step in range(steps):
        for r, (m, opt) in enumerate(zip(replicas, opts)):
            x, y = task.batch(step, r, world, task.per_worker)
            opt.zero_grad(set_to_none=True)
            task.loss(m(x), y).backward()
            opt.step()
        if (step + 1) % cfg["H"] == 0:
            with torch.no_grad():
                deltas = [anchor - parameters_to_vector(m.parameters()) for m in replicas]
                if cfg["diloco"]:
                    d = sum(deltas) / world
                    momentum.mul_(0.9).add_(d)
                    anchor.sub_(d.add(momentum, alpha=0.9), alpha=cfg["olr"])
                elif cfg["dense"]:  # the same accumulator, everything sent: e <- βe + Δ, send e, e <- 0
                    sent = []
                    for r in range(world):
                        residuals[r].mul_(cfg["decay"]).add_(deltas[r])
                        sent.append(residuals[r].clone())
                        residuals[r].zero_()
                    anchor.sub_(sum(sent) / world, alpha=cfg["olr"])
                else:
                    msgs = [c.encode(d, "pseudo", 1.0) for c, d in zip(comps, deltas)]
                    anchor.sub_(comps[0].sum_messages(msgs, anchor.numel()), alpha=cfg["olr"])
                for m in replicas:  # copies (vector_to_parameters would make every replica a view of the anchor)
                    vector_to_parameters(anchor.clone(), m.parameters())
        if (step + 1) % eval_every == 0:
            points.append((step + 1, task.evaluate(replicas[0])))
    return points


def main(argv: list[str] | None = None) -> int:
    import torch

    from benchmarks.quality.tasks import get

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--task", default="gpt")
    p.add_argument("--configs", nargs="+", required=True)
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--steps", type=int, default=180)
    p.add_argument("--eval-every", type=int, default=8)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--target", type=float, default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    task = get(args.task)
    target = task.target if args.target is None else args.target
    for config in args.configs:
        cfg = parse(config)
        firsts, finals = [], []
        started = time.perf_counter()
        for seed in (int(s) for s in args.seeds.split(",")):
            points = run(args.task, cfg, seed, args.steps, args.eval_every, args.world)
            firsts.append(next((s for s, q in points if task.reached(q, target)), None))
            finals.append(points[-1][1])
            print(f"  {config} seed {seed}: " + ", ".join(f"{s}: {q:.3f}" for s, q in points[1::2]),
                  file=sys.stderr, flush=True)
        print(f"{config}: reached {target} at {firsts}, final {[round(f, 3) for f in finals]} "
              f"({time.perf_counter() - started:.0f} s)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
