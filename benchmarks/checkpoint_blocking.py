"""How long a checkpoint blocks training: ``px.save_checkpoint`` synchronous vs asynchronous.

A model of about 100M parameters (a stack of square linear layers) trains with AdamW in one
process; after a few steps it saves a checkpoint, ``--repeat`` times each way:

* synchronous (``blocking=True``): the step waits until every file is written and renamed;
* asynchronous (``blocking=False``): the step waits only for the staging copy, then the
  next steps run while DCP writes in a background thread; the figure is the call's own time
  plus how much the next step was slowed down (compared with a step without a save).

    python benchmarks/checkpoint_blocking.py [--width 2048] [--layers 24] [--repeat 2] [--dir DIR]

Prints one line per mode: the median seconds a step is blocked, and async / sync.
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time

import torch
from torch import nn

import phalanx as px


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    args = parser.parse_args()

    px.init()
    model = nn.Sequential(*[nn.Linear(args.width, args.width) for _ in range(args.layers)])
    model, opt = px.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-4))
    params = sum(p.numel() for p in model.parameters())
    x = torch.randn(args.batch, args.width)

    def step() -> float:
        started = time.perf_counter()
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
        return time.perf_counter() - started

    for _ in range(2):
        step()  # warm-up, and AdamW's moments exist
    plain = statistics.median(step() for _ in range(3))
    where = args.dir or tempfile.mkdtemp(prefix="phalanx-ckpt-bench-")
    path = os.path.join(where, "ckpt")
    blocked: dict[str, list[float]] = {"sync": [], "async": [], "call": []}
    for _ in range(args.repeat):
        started = time.perf_counter()
        px.save_checkpoint(path, model, opt, step=1)
        blocked["sync"].append(time.perf_counter() - started)

        started = time.perf_counter()
        handle = px.save_checkpoint(path, model, opt, step=2, blocking=False)
        call = time.perf_counter() - started
        slowed = step() - plain  # the next step runs while the files are written
        blocked["async"].append(call + max(0.0, slowed))
        blocked["call"].append(call)
        handle.wait()
    sync, asynchronous = statistics.median(blocked["sync"]), statistics.median(blocked["async"])
    size = sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path)) / 2**20
    print(f"model: {params / 1e6:.1f}M parameters, AdamW; checkpoint {size:,.0f} MiB; plain step {plain:.3f} s")
    print(f"synchronous:  step blocked {sync:.3f} s (median of {args.repeat})")
    print(f"asynchronous: step blocked {asynchronous:.3f} s (median of {args.repeat}) = "
          f"{asynchronous / sync:.1%} of synchronous; of which the call (staging copy) "
          f"{statistics.median(blocked['call']):.3f} s, the rest the next step's slow-down")
    if args.dir is None:
        shutil.rmtree(where, ignore_errors=True)
    px.shutdown()


if __name__ == "__main__":
    main()
