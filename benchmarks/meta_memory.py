"""Peak memory per worker while a model 4x one worker's share is built and sharded: on the meta device vs whole.

Run from the repository root (4 worker processes per build, the two builds one after the other):

    python benchmarks/meta_memory.py                               # 4 workers, 16 x Linear(2048, 2048): 67.1M
    python benchmarks/meta_memory.py --layers 4 --width 1024 --steps 1   # a small, quick one

Each worker first wraps and steps a tiny model the same way (the mesh, its process groups and FSDP's first-use
costs are then paid), records its resident set (``VmRSS``) and resets the kernel's peak counter
(``/proc/self/clear_refs``); then builds the model and wraps it with ``shard=px.FullyShard(group_size=N,
units=nn.Linear)`` (plain FSDP over the N workers, one unit per layer): built **whole** (every worker builds the
model and receives rank 0's weights, then ``fully_shard`` splits them) or on the **meta** device (sharded first,
then each worker allocates its own shards, ``to_empty``, and each layer's ``reset_parameters`` fills them). "build
peak" is ``VmHWM`` after ``px.wrap`` minus the resident set before the model: what a worker needed to hold at
once to get its shards. Then the counter is reset again and ``--steps`` AdamW steps run ("training peak": the
shards of the parameters, gradients and AdamW state plus the gathered weights and gradient of one unit at a
time). Largest over the workers. The model is N times one worker's share; the target for the build is at most
that share plus one unit whole.

Workers run with ``MALLOC_MMAP_THRESHOLD_=1048576`` (as benchmarks/sharded_memory.py: with glibc's default, the
buffers FSDP frees every step stay in the resident set).
"""
from __future__ import annotations

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
os.environ["PYTHONPATH"] = os.pathsep.join([os.path.join(ROOT, "benchmarks"), os.path.join(ROOT, "src"),
                                            os.environ.get("PYTHONPATH", "")])
sys.path[:0] = [os.path.join(ROOT, "src")]

from sharded_memory import arguments, measure, reset_peak, status_bytes, table, train  # noqa: E402  (path above)


def worker(meta: bool, layers: int, width: int, steps: int) -> dict:
    """One worker: build (whole or on the meta device), wrap, train; its measured memory in bytes."""
    import contextlib
    import gc

    import torch
    import torch.distributed.fsdp  # noqa: F401  (its code is not the model's memory: loaded before measuring)
    from torch import nn

    import phalanx as px

    px.init()
    torch.set_num_threads(1)

    def build(layers: int, width: int) -> tuple[nn.Module, torch.optim.Optimizer]:
        with torch.device("meta") if meta else contextlib.nullcontext():
            model = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        return px.wrap(model, opt, shard=px.FullyShard(group_size=px.world_size(), units=nn.Linear))

    # A small model first, through the same path: the mesh, its process groups and FSDP's first-use costs are
    # then paid, and what follows measures the model.
    small, small_opt = build(2, 8)
    small(torch.ones(1, 8)).sum().backward()
    small_opt.step()
    del small, small_opt
    gc.collect()
    before = status_bytes("VmRSS")
    reset_peak()
    torch.manual_seed(0)
    model, opt = build(layers, width)
    gc.collect()
    build_peak = status_bytes("VmHWM") - before
    held = status_bytes("VmRSS") - before
    reset_peak()
    train(model, opt, width, steps)
    params = sum(p.numel() for p in model.parameters())
    return {"params": params, "build_peak": build_peak, "held": held,
            "training_peak": status_bytes("VmHWM") - before,
            "shard_bytes": sum(p.to_local().numel() * p.element_size() for p in model.parameters())}


def main() -> int:
    args = arguments(__doc__, layers=16, width=2048, steps=2).parse_args()
    rows = {}
    for meta in (False, True):
        out = measure("meta_memory:worker", args, meta=meta)
        rows["meta" if meta else "whole"] = {k: max(r[k] for r in out) for k in out[0]}
    params = rows["meta"]["params"]
    whole, unit = params * 4, (args.width * args.width + args.width) * 4
    share = rows["meta"]["shard_bytes"]
    mib = 2 ** 20
    print(f"{args.workers} workers, {params / 1e6:.1f}M parameters ({args.layers} x Linear({args.width}, "
          f"{args.width})), FullyShard(group_size={args.workers}, units=nn.Linear), AdamW, {args.steps} steps, "
          f"max over workers, MALLOC_MMAP_THRESHOLD_={args.mmap_threshold or 'glibc default'}")
    print(f"whole model {whole / mib:,.0f} MiB; one worker's share {share / mib:,.0f} MiB; one unit "
          f"{unit / mib:,.0f} MiB; target for the build: share + one unit = {(share + unit) / mib:,.0f} MiB")
    labels = {"meta": "on the meta device", "whole": "whole on every worker"}
    return table("| build | build peak per worker | x (share + one unit) | held after px.wrap | training peak |",
                 [f"| {labels[name]} | {r['build_peak'] / mib:,.0f} MiB | {r['build_peak'] / (share + unit):.2f} | "
                  f"{r['held'] / mib:,.0f} MiB | {r['training_peak'] / mib:,.0f} MiB |" for name, r in rows.items()],
                 rows)


if __name__ == "__main__":
    sys.exit(main())
