"""Worker functions for tests/test_bench.py; each runs in every rank of a real gloo group."""
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
    from phalanx.callbacks import LambdaCallback
    from phalanx.trainer import Trainer

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
