"""Worker functions for tests/bench/test_bench.py; each runs in every rank of a real gloo group."""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


def bench_run(setup: str, steps: int = 6, warmup: int = 2, model: str = "mlp", batch: int = 16) -> dict[str, Any]:
    """One configuration of the benchmark's own worker loop, on this rank."""
    from phalanx.bench.spec import parse_setup
    from phalanx.bench.worker import run

    s = parse_setup(setup)
    return run({"model": model, "setup": {"name": s.name, "kwargs": s.kwargs}, "batch": batch, "threads": 1,
                "warmup": warmup, "steps": steps})


def trainer_breakdown(strategy: str = "allreduce", epochs: int = 2) -> dict[str, Any]:
    """px.Trainer with the StepBreakdown callback; returns its records and the Trainer's own step times."""
    import phalanx as px
    from phalanx.bench.breakdown import StepBreakdown
    from phalanx.train.callbacks import LambdaCallback
    from phalanx.train.trainer import Trainer

    px.init()
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(32, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 4))
    data = torch.utils.data.TensorDataset(torch.randn(512, 32), torch.randint(0, 4, (512,)))
    breakdown = StepBreakdown(warmup_steps=2)
    logged: list[float] = []
    keep = LambdaCallback(on_step_end=lambda trainer, step, logs: logged.append(logs["step_s"]))
    trainer = Trainer(net, torch.optim.SGD(net.parameters(), lr=0.05), F.cross_entropy, strategy=strategy,
                      callbacks=[breakdown, keep])
    trainer.fit(data, epochs=epochs, batch_size=32, progress=False)
    return {"records": breakdown.records, "summary": breakdown.summary(), "logged_step_s": logged}


def post_local_phases(warmup: int = 3, every: int = 4, steps: int = 13) -> dict[str, Any]:
    """torch's post-local SGD peer of the quality benchmark beside px.LocalSGD, on different data per rank.

    Per setup: the steps after which the two replicas are equal, and the bytes each one counted.
    """
    import torch.distributed as dist

    import phalanx as px
    from benchmarks.quality.setups import torch_post_local
    from phalanx.bench.worker import StrategyAccountant

    px.init()
    rank = dist.get_rank()
    out: dict[str, Any] = {}
    for name in ("torch", "phalanx"):
        torch.manual_seed(0)  # the same initial model on both ranks and for both setups
        net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3))
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        if name == "torch":
            module, opt, acc = torch_post_local(warmup, every)(net, opt, 0.1)
        else:
            strategy = px.LocalSGD(every=every, warmup_steps=warmup)
            module, opt = px.wrap(net, opt, strategy=strategy)
            acc = StrategyAccountant(strategy)
        bytes0 = acc.bytes_sent()
        gen = torch.Generator().manual_seed(100 + rank)  # each rank its own data
        equal = []
        for step in range(1, steps + 1):
            x, y = torch.randn(16, 8, generator=gen), torch.randint(0, 3, (16,), generator=gen)
            opt.zero_grad()
            F.cross_entropy(module(x), y).backward()
            opt.step()
            flat = torch.cat([p.detach().reshape(-1) for p in net.parameters()])
            both = [torch.empty_like(flat) for _ in range(2)]
            dist.all_gather(both, flat)
            if torch.equal(both[0], both[1]):
                equal.append(step)
        out[name] = {"equal_after": equal, "bytes": acc.bytes_sent() - bytes0,
                     "averaged_at": getattr(acc, "averaged_at", None),
                     "param_bytes": sum(p.numel() * p.element_size() for p in net.parameters())}
    return out
