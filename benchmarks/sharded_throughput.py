"""Throughput of FSDP (px.FullyShard(group_size=2)) vs replicated px.AllReduce on 2 workers: MLP, GPT, ResNet-20.

Run from the repository root (2 worker processes per setup, one setup after the other):

    python benchmarks/sharded_throughput.py                          # median of 3 reps of 10 steps, all three
    python benchmarks/sharded_throughput.py --reps 5 --steps 20 --models mlp

Each worker trains on synthetic data with AdamW, batch ``--batch`` (MLP) or ``--gpt-batch`` sequences of 64
tokens (GPT) per worker, after 2 warm-up steps;
a rep is ``--steps`` steps timed on each worker (the slowest worker's time counts). Samples/s is the
global batch times steps over that time; the table gives the median over the reps and the ratio
FSDP / replicated. The MLP is ``phalanx.bench.models.mlp()`` (784-5x1024-10, one FSDP unit per
Linear); the GPT is ``gpt(vocab=8192, context=64, dim=256, layers=4, heads=4)`` sharded as one FSDP
unit (its output layer is tied to the token embedding, so the two must stay in one unit); ResNet-20
(``resnet_cifar(20)``, 0.27M parameters, ``--batch`` 32x32 images per worker) is sharded with
``FullyShard(min_params=20_000)``: a unit per submodule holding 20k parameters not in a smaller unit.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
os.environ["PYTHONPATH"] = os.pathsep.join([os.path.join(ROOT, "benchmarks"), os.path.join(ROOT, "src"),
                                            os.environ.get("PYTHONPATH", "")])
sys.path[:0] = [os.path.join(ROOT, "src")]

GPT = {"vocab": 8192, "context": 64, "dim": 256, "layers": 4, "heads": 4}


def worker(model_name: str, shard: int, batch: int, steps: int, reps: int) -> dict:
    """Train ``model_name`` replicated (shard 1) or sharded; return each rep's seconds for ``steps`` steps."""
    import time

    import torch
    import torch.nn.functional as F

    import phalanx as px
    from phalanx.bench import models

    px.init()
    torch.manual_seed(0)
    if model_name == "gpt":
        net, units = models.gpt(**GPT), 10**12
        x = torch.randint(0, GPT["vocab"], (batch, GPT["context"]))
        y = torch.randint(0, GPT["vocab"], (batch, GPT["context"]))

        def loss(out: torch.Tensor) -> torch.Tensor:
            return F.cross_entropy(out.flatten(0, 1), y.flatten())
    elif model_name == "resnet20":
        net, units = models.resnet_cifar(20), 20_000
        x, y = torch.randn(batch, 3, 32, 32), torch.randint(0, 10, (batch,))

        def loss(out: torch.Tensor) -> torch.Tensor:
            return F.cross_entropy(out, y)
    else:
        net, units = models.mlp(), 1024 * 784
        x, y = torch.randn(batch, 784), torch.randint(0, 10, (batch,))

        def loss(out: torch.Tensor) -> torch.Tensor:
            return F.cross_entropy(out, y)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-4)
    model, opt = px.wrap(net, opt, strategy=px.AllReduce(),
                         shard=px.FullyShard(group_size=shard, min_params=units) if shard > 1 else None)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        loss(model(x)).backward()
        opt.step()

    for _ in range(2):
        step()
    times = []
    for _ in range(reps):
        px.barrier()
        start = time.perf_counter()
        for _ in range(steps):
            step()
        times.append(time.perf_counter() - start)
    return {"times": times, "params": sum(p.numel() for p in net.parameters())}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="mlp,gpt,resnet20")
    parser.add_argument("--batch", type=int, default=32, help="MLP or ResNet-20 samples per worker per step")
    parser.add_argument("--gpt-batch", type=int, default=8, help="GPT sequences (of 64 tokens) per worker per step")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=900.0)
    args = parser.parse_args()
    from phalanx.bench.procs import run_workers

    print(f"2 workers, AdamW, batch {args.batch} (MLP, ResNet-20) / {args.gpt_batch} x 64 tokens (GPT) per worker, "
          f"median of {args.reps} reps of {args.steps} steps")
    print("| model | replicated (AllReduce) samples/s | FSDP S=2 samples/s | FSDP / replicated |\n|---|---|---|---|")
    rows = []
    for name in args.models.split(","):
        rate, batch = {}, args.gpt_batch if name == "gpt" else args.batch
        for shard in (1, 2):
            out = run_workers("sharded_throughput:worker", world_size=2, timeout=args.timeout, model_name=name,
                              shard=shard, batch=batch, steps=args.steps, reps=args.reps).results
            slowest = [max(ts) for ts in zip(*(r["times"] for r in out), strict=True)]
            rate[shard] = statistics.median(2 * batch * args.steps / t for t in slowest)
        rows.append({"model": name, "params": out[0]["params"], "replicated": rate[1], "fsdp": rate[2]})
        print(f"| {name} ({out[0]['params'] / 1e6:.1f}M) | {rate[1]:,.0f} | {rate[2]:,.0f} | {rate[2] / rate[1]:.2f} |")
    print(json.dumps(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
