"""A model whose replicated training state does not fit a per-worker memory limit trains when sharded.

Run from the repository root (2 workers per layout, one layout after the other):

    python benchmarks/sharded_oom.py                      # 16 x Linear(1024, 1024), 16.8M parameters, AdamW
    python benchmarks/sharded_oom.py --limit-mb 300       # another limit (MiB above the worker's start)

Each worker, once ``px.init()`` and torch's distributed modules are loaded, caps its own address space
(``RLIMIT_AS``) at what it uses then plus ``--limit-mb``: the allocations of training must fit in that
budget. AdamW in fp32 needs 16 bytes per parameter replicated (weights, gradients, two moments); with
``shard=px.FullyShard(group_size=2, min_params=...)`` (one FSDP unit per layer) a worker holds half of
each, plus one layer's full weights and gradients at a time. The replicated layout fails with a clear
out-of-memory line; the sharded one trains. Workers run with ``MALLOC_ARENA_MAX=1`` (each malloc arena
reserves 64 MiB of address space, which would count against the cap without being used) and
``MALLOC_MMAP_THRESHOLD_=1048576`` (large buffers go back to the system when freed).
"""
from __future__ import annotations

import argparse
import sys

# importing it puts benchmarks/ and src/ on this process's and its workers' paths, as it does for its own
from sharded_memory import status_bytes as _vm


def worker(shard: int, layers: int, width: int, steps: int, limit_mb: int) -> dict:
    """Cap this worker's address space, then build, wrap and train; report how far it got."""
    import resource

    import torch
    import torch.distributed.fsdp  # noqa: F401 - loaded before the cap: its code is not training state
    from torch import nn

    import phalanx as px

    px.init()
    torch.set_num_threads(1)
    start = _vm("VmSize")
    resource.setrlimit(resource.RLIMIT_AS, (start + limit_mb * 2**20, resource.RLIM_INFINITY))
    phase = "building the model"
    try:
        torch.manual_seed(0)
        model = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])
        params = sum(p.numel() for p in model.parameters())
        phase = "wrapping it"
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        shard_with = px.FullyShard(group_size=shard, min_params=width * width) if shard > 1 else None
        model, opt = px.wrap(model, opt, strategy=px.AllReduce(), shard=shard_with)
        gen = torch.Generator().manual_seed(px.rank())
        for step in range(steps):
            phase = f"training step {step + 1}"
            x = torch.randn(8, width, generator=gen)
            opt.zero_grad(set_to_none=True)
            model(x).pow(2).mean().backward()
            opt.step()
    except (MemoryError, RuntimeError) as err:  # torch's CPU allocator raises RuntimeError, Python MemoryError
        return {"ok": False, "phase": phase, "error": f"{type(err).__name__}: {str(err).splitlines()[0][:160]}",
                "used": _vm("VmHWM")}
    return {"ok": True, "params": params, "steps": steps, "peak_vm": _vm("VmPeak") - start}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--limit-mb", type=int, default=240, help="address space allowed above the start, MiB")
    parser.add_argument("--timeout", type=float, default=600.0)
    args = parser.parse_args()
    from phalanx.bench.procs import run_workers

    params = args.layers * (args.width * args.width + args.width)
    print(f"2 workers, {params / 1e6:.1f}M parameters (AdamW state replicated: {16 * params / 2**20:,.0f} MiB), "
          f"address space capped at start + {args.limit_mb} MiB per worker")
    env = {"MALLOC_ARENA_MAX": "1", "MALLOC_MMAP_THRESHOLD_": str(1 << 20)}
    for shard in (1, 2):
        run = run_workers("sharded_oom:worker", world_size=2, timeout=args.timeout, env=env, check=False,
                          shard=shard, layers=args.layers, width=args.width, steps=args.steps,
                          limit_mb=args.limit_mb)
        name = "replicated (AllReduce)" if shard == 1 else "sharded (FullyShard(group_size=2), FSDP)"
        results = [r for r in (run.results or []) if r]
        if len(results) < 2:
            print(f"{name}: a worker ended without a result (return codes {run.returncodes})")
        elif all(r["ok"] for r in results):
            print(f"{name}: trained {args.steps} steps; peak address space above the start "
                  f"{max(r['peak_vm'] for r in results) / 2**20:,.0f} MiB per worker")
        else:
            bad = next(r for r in results if not r["ok"])
            print(f"{name}: out of memory while {bad['phase']} (the cap is start + {args.limit_mb} MiB): "
                  f"{bad['error']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
