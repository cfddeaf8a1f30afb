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


def reset_peak() -> None:
    """Reset the kernel's peak counter (``VmHWM`` := ``VmRSS``): from here on ``VmHWM`` is this phase's peak."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def train(model, opt, width: int, steps: int) -> None:
    """``steps`` optimizer steps on random batches of 8 (seeded by rank): the load both memory benchmarks measure."""
    import torch

    import phalanx as px

    gen = torch.Generator().manual_seed(px.rank())
    for _ in range(steps):
        x = torch.randn(8, width, generator=gen)
        opt.zero_grad(set_to_none=True)
        model(x).pow(2).mean().backward()
        opt.step()


def arguments(doc: str, *, layers: int, width: int, steps: int) -> argparse.ArgumentParser:
    """The memory benchmarks' common options (meta_memory.py parses these too), with this benchmark's defaults."""
    parser = argparse.ArgumentParser(description=doc.split("\n")[0])
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--layers", type=int, default=layers)
    parser.add_argument("--width", type=int, default=width)
    parser.add_argument("--steps", type=int, default=steps)
    parser.add_argument("--timeout", type=float, default=900.0)
    parser.add_argument("--mmap-threshold", type=int, default=1 << 20,
                        help="MALLOC_MMAP_THRESHOLD_ for the workers, bytes (0: glibc's default)")
    return parser


def table(head: str, lines: list[str], rows: object) -> int:
    """Print a markdown table (``head``, its rule, ``lines``), then the raw ``rows`` as JSON; 0, the exit status."""
    print(head + "\n|" + "---|" * (head.count("|") - 1))
    print("\n".join(lines))
    print(json.dumps(rows))
    return 0


def measure(target: str, args: argparse.Namespace, **kwargs) -> list[dict]:
    """Each worker's measurement: ``target`` on ``args.workers`` processes with the parsed model size and the
    allocator threshold (the same in every layout, see the docstring)."""
    from phalanx.bench.procs import run_workers

    env = {"MALLOC_MMAP_THRESHOLD_": str(args.mmap_threshold)} if args.mmap_threshold else {}
    return run_workers(target, world_size=args.workers, timeout=args.timeout, env=env, layers=args.layers,
                       width=args.width, steps=args.steps, **kwargs).results


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
    reset_peak()  # from here on VmHWM is the training peak
    train(model, opt, width, steps)
    return {"params": params, "before": before, "training_peak": status_bytes("VmHWM") - before,
            "process_peak": int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024}


def main() -> int:
    parser = arguments(__doc__, layers=12, width=2896, steps=3)
    parser.add_argument("--shards", default="1,2,4", help="comma list of group sizes S (1: replicated)")
    args = parser.parse_args()

    rows = []
    for s in (int(v) for v in args.shards.split(",")):
        out = measure("sharded_memory:worker", args, shard=s)
        rows.append({"shard": s, "params": out[0]["params"],
                     "training_peak": max(r["training_peak"] for r in out),
                     "process_peak": max(r["process_peak"] for r in out)})
    base = next((r for r in rows if r["shard"] == 1), rows[0])
    print(f"{args.workers} workers, {rows[0]['params'] / 1e6:.1f}M parameters, AdamW, {args.steps} steps "
          f"(max over workers), MALLOC_MMAP_THRESHOLD_={args.mmap_threshold or 'glibc default'}")

    def name(s: int) -> str:
        return "replicated (AllReduce)" if s == 1 else \
            f"S={s} (R={args.workers // s}, {'FSDP' if s == args.workers else 'HSDP'})"

    return table("| layout | training peak per worker | x replicated | process peak per worker |",
                 [f"| {name(r['shard'])} | {r['training_peak'] / 2**20:,.0f} MiB | "
                  f"{r['training_peak'] / base['training_peak']:.2f} | {r['process_peak'] / 2**20:,.0f} MiB |"
                  for r in rows], rows)


if __name__ == "__main__":
    sys.exit(main())
