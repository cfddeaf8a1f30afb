"""torch.compile under phalanx and under plain DDP: training samples/s, compiled vs eager.

    python benchmarks/compile.py                                   # ResNet-20 and the GPT, 1 and 2 workers
    python benchmarks/compile.py --quick                           # the same cells, 3 steps, 1 run: does it work
    python benchmarks/compile.py --models gpt --workers 2 --steps 10 --repeats 5 --backend inductor

For each model, worker count and setup it starts fresh worker processes (gloo on CPU;
one GPU each where CUDA is present) and trains on synthetic data:

* ``phalanx``: ``px.wrap(torch.compile(net), opt)`` (compiled) or ``px.wrap(net, opt)`` (eager);
* ``ddp``: ``torch.compile(DistributedDataParallel(net))`` or ``DistributedDataParallel(net)``;
  with one worker, the plain module (what DDP would be).

Each run times ``--steps`` steps after ``--warmup`` steps (the first one compiles, so its
time is reported apart as ``first step``). Each cell runs ``--repeats`` times, eager and
compiled taking turns, and prints the medians: samples/s (all workers together),
compiled/eager, and the graphs dynamo built (``phalanx.step.compiled.compilations``; a number
growing with the steps would mean a recompilation per step).
Models: ResNet-20 (CIFAR shapes, batch 32 per worker) and a small GPT
(``gpt(vocab=256, context=64, dim=128, layers=3, heads=4)``, batch 16 sequences).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
MODELS = {"resnet20": 32, "gpt": 16}  # per-worker batch


def _model_and_batch(name: str, batch: int) -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor, bool]:
    from phalanx.bench.models import gpt, resnet_cifar
    torch.manual_seed(0)
    if name == "gpt":
        net = gpt(vocab=256, context=64, dim=128, layers=3, heads=4)
        x = torch.randint(0, 256, (batch, 64))
        return net, x, torch.randint(0, 256, (batch, 64)), True
    return resnet_cifar(20), torch.randn(batch, 3, 32, 32), torch.randint(0, 10, (batch,)), False


def worker(model: str, setup: str, compiled: bool, steps: int, warmup: int, backend: str) -> dict:
    """One worker of one run: returns its timings (rank 0's are reported)."""
    import phalanx as px
    from phalanx.step.compiled import compilations
    px.init()
    dev = px.device()
    net, x, y, seq = _model_and_batch(model, MODELS[model])
    net, x, y = net.to(dev), x.to(dev), y.to(dev)
    opt = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)
    if setup == "phalanx":
        run, opt = px.wrap(torch.compile(net, backend=backend) if compiled else net, opt)
    else:
        from torch.nn.parallel import DistributedDataParallel
        run = DistributedDataParallel(net, device_ids=[dev] if dev.type == "cuda" else None) \
            if px.world_size() > 1 else net
        run = torch.compile(run, backend=backend) if compiled else run
    graphs0 = compilations()

    def step() -> None:
        opt.zero_grad()
        out = run(x)
        loss = F.cross_entropy(out.flatten(0, 1), y.flatten()) if seq else F.cross_entropy(out, y)
        loss.backward()
        opt.step()

    t0 = time.perf_counter()
    step()
    if dev.type == "cuda":
        torch.cuda.synchronize()
    compile_s = time.perf_counter() - t0
    for _ in range(warmup - 1):
        step()
    px.barrier()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    if dev.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    return {"samples_per_s": MODELS[model] * px.world_size() * steps / seconds, "first_step_s": compile_s,
            "graphs": compilations() - graphs0}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    p.add_argument("--workers", nargs="+", type=int, default=[1, 2])
    p.add_argument("--setups", nargs="+", default=["phalanx", "ddp"], choices=["phalanx", "ddp"])
    p.add_argument("--steps", type=int, default=None, help="timed steps per run (default 10; --quick 3)")
    p.add_argument("--warmup", type=int, default=None, help="steps before timing, the compiling one included "
                   "(default 3; --quick 2)")
    p.add_argument("--repeats", type=int, default=None, help="runs of each cell, eager and compiled taking turns; "
                   "the medians are printed (default 3; --quick 1)")
    p.add_argument("--quick", action="store_true", help="prove it runs: 3 steps, 2 warm-up, 1 repeat")
    p.add_argument("--backend", default="inductor")
    p.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    p.add_argument("--out", help="write the rows as JSON here")
    args = p.parse_args(argv)
    quick = args.quick
    steps = args.steps if args.steps is not None else (3 if quick else 10)
    warmup = args.warmup if args.warmup is not None else (2 if quick else 3)
    repeats = args.repeats if args.repeats is not None else (1 if quick else 3)
    from phalanx.bench.procs import run_workers
    env = {"PYTHONPATH": os.pathsep.join([HERE, os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": str(args.threads), "PHALANX_THREADS": str(args.threads)}
    rows = []
    print(f"{steps} timed steps after {warmup} warm-up, medians of {repeats} run(s) each, backend {args.backend}; "
          f"samples/s of all workers together", flush=True)
    print(f"{'model':9} {'n':>2} {'setup':8} {'eager/s':>9} {'compiled/s':>10} {'ratio':>6} {'first step':>10} "
          f"{'graphs':>6}", flush=True)
    for model in args.models:
        for n in args.workers:
            for setup in args.setups:
                got: dict[bool, list[dict]] = {False: [], True: []}
                for _ in range(repeats):
                    for compiled in (False, True):  # taking turns: a change of load touches both alike
                        got[compiled].append(run_workers(
                            "compile:worker", world_size=n, timeout=1800, env=env, model=model, setup=setup,
                            compiled=compiled, steps=steps, warmup=warmup, backend=args.backend).results[0])
                eager = [r["samples_per_s"] for r in got[False]]
                comp = [r["samples_per_s"] for r in got[True]]
                row = {"model": model, "workers": n, "setup": setup, "eager": statistics.median(eager),
                       "compiled": statistics.median(comp), "eager_runs": eager, "compiled_runs": comp,
                       "first_step_s": statistics.median(r["first_step_s"] for r in got[True]),
                       "graphs": max(r["graphs"] for r in got[True])}
                rows.append(row)
                print(f"{model:9} {n:>2} {setup:8} {row['eager']:9.1f} {row['compiled']:10.1f} "
                      f"{row['compiled'] / row['eager']:6.2f} {row['first_step_s']:9.1f}s {row['graphs']:>6}",
                      flush=True)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "compile.json"), "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
