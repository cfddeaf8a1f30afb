"""Peak memory per worker, replicated vs sharded (px.FullyShard), for a ~100M-parameter model with AdamW.

Run from the repository root (4 worker processes per layout, 3 layouts one after the other;
the replicated layout needs about 2 GB per worker, 8 GB in all):

    python benchmarks/sharded_memory.py                      # 4 workers: replicated, S=2, S=4
    python benchmarks/sharded_memory.py --workers 2 --layers 4 --steps 2   # a small, quick one

Each worker records its resident set (``VmRSS``) after ``px.init()``, before the model exists;
then builds the model (12 x Linear(2896, 2896), 100.7M parameters), wraps it (replicated: px.AllReduce,
DDP; sharded: ``shard=px.FullyShard(group_size=S)``, HSDP), resets the kernel's peak counter
(``/proc/self/clear_refs``) and trains ``--steps`` steps of AdamW. "training peak" is ``VmHWM`` at
the end minus the resident set before the model: the parameters, gradients, optimizer state and
the transient full weights of one FSDP unit, measured. "process peak" is ``ru_maxrss``, which
also holds the start (the whole model is built on every worker before it is sharded).

Workers run with ``MALLOC_MMAP_THRESHOLD_=1048576`` (``--mmap-threshold``; 0 keeps glibc's default) in every
layout: FSDP allocates and frees a unit's full weights and gradients every step, and with glibc's default
(a threshold that grows up to 32 MiB) those freed buffers stay in the heap and count in the resident set.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
os.environ["PYTHONPATH"] = os.pathsep.join([os.path.join(ROOT, "benchmarks"), os.path.join(ROOT, "src"),
                                            os.environ.get("PYTHONPATH", "")])
sys.path[:0] = [os.path.join(ROOT, "src")]


def status_bytes(field: str) -> int:
    """A ``/proc/self/status`` field in bytes (``VmRSS``, ``VmHWM``, ``VmSize``); sharded_oom.py reads them too."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def worker(shard: int, layers: int, width: int, steps: int) -> dict:
    """One worker: build, wrap, train; return its measured memory (bytes)."""
    import gc
    import resource

    import torch
    from torch import nn

    import phalanx as px

    px.init()
    torch.set_num_threads(1)
    before = status_bytes("VmRSS")
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])
    params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model, opt = px.wrap(model, opt, strategy=px.AllReduce(),
                         shard=px.FullyShard(group_size=shard) if shard > 1 else None)
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM: from here on it is the training peak
    gen = torch.Generator().manual_seed(px.rank())
    for _ in range(steps):
        x = torch.randn(8, width, generator=gen)
        opt.zero_grad(set_to_none=True)
        model(x).pow(2).mean().backward()
        opt.step()
    return {"params": params, "before": before, "training_peak": status_bytes("VmHWM") - before,
            "process_peak": int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--width", type=int, default=2896)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--shards", default="1,2,4", help="comma list of group sizes S (1: replicated)")
    parser.add_argument("--timeout", type=float, default=900.0)
    parser.add_argument("--mmap-threshold", type=int, default=1 << 20,
                        help="MALLOC_MMAP_THRESHOLD_ for the workers, bytes (0: glibc's default)")
    args = parser.parse_args()
    from phalanx.bench.procs import run_workers

    rows = []
    for s in (int(v) for v in args.shards.split(",")):
        env = {"MALLOC_MMAP_THRESHOLD_": str(args.mmap_threshold)} if args.mmap_threshold else {}
        out = run_workers("sharded_memory:worker", world_size=args.workers, timeout=args.timeout, env=env,
                          shard=s, layers=args.layers, width=args.width, steps=args.steps).results
        rows.append({"shard": s, "params": out[0]["params"],
                     "training_peak": max(r["training_peak"] for r in out),
                     "process_peak": max(r["process_peak"] for r in out)})
    base = next((r for r in rows if r["shard"] == 1), rows[0])
    print(f"{args.workers} workers, {rows[0]['params'] / 1e6:.1f}M parameters, AdamW, {args.steps} steps "
          f"(max over workers), MALLOC_MMAP_THRESHOLD_={args.mmap_threshold or 'glibc default'}")
    print("| layout | training peak per worker | x replicated | process peak per worker |\n|---|---|---|---|")
    for r in rows:
        name = "replicated (AllReduce)" if r["shard"] == 1 else \
            f"S={r['shard']} (R={args.workers // r['shard']}, {'FSDP' if r['shard'] == args.workers else 'HSDP'})"
        print(f"| {name} | {r['training_peak'] / 2**20:,.0f} MiB | {r['training_peak'] / base['training_peak']:.2f} | "
              f"{r['process_peak'] / 2**20:,.0f} MiB |")
    print(json.dumps(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
