"""The preemption tests' loop and oracle: the workers' resumable loop, and tests/workers/preempt.py's model trained
by one plain-torch process."""
from __future__ import annotations

import os
from typing import Any, Callable

import torch

from support.loop import train


def train_preemptible(model: torch.nn.Module, opt: torch.optim.Optimizer, loader: Any, epochs: int,
                      on_step: Callable[[int], None] = lambda step: None,
                      before_save: Callable[[], None] = lambda: None) -> int:
    """The user's loop under ``phalanx run --checkpoint-dir``: resume from ``px.resume_from()`` if any; after each
    step ``on_step(step)``, then, once preempted, ``before_save()``, a checkpoint, and exit ``px.PREEMPTED_EXIT``.

    Example:
        >>> # train_preemptible(model, opt, px.shard(data, batch_size=4, shuffle=True, seed=0), epochs=2)
    """
    import phalanx as px

    step = 0
    if px.resume_from() is not None:
        step = int(px.load_checkpoint(px.resume_from(), model, opt, loader=loader)["step"])

    def after(step: int) -> None:
        on_step(step)
        if px.preempted():
            before_save()
            px.save_checkpoint(os.path.join(px.step.preempt.checkpoint_dir(), f"step-{step}.pt"), model, opt,
                               loader=loader, step=step)
            raise SystemExit(px.PREEMPTED_EXIT)

    return train(model, opt, loader, epochs, after, start_epoch=loader.sampler.epoch, step=step)

def oracle() -> torch.nn.Module:
    """The worker's model trained by one plain-torch process on the global batches (2 x 4 samples)."""
    from phalanx.data.loader import global_batches
    from workers import preempt as w
    torch.manual_seed(1)
    net = w.make_model()
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    x, y = w.data().tensors
    for epoch in range(w.EPOCHS):
        for parts in global_batches(w.N, 2 * w.BATCH, 1, shuffle=True, seed=0, epoch=epoch):
            idx = torch.tensor(parts[0])
            opt.zero_grad()
            torch.nn.functional.cross_entropy(net(x[idx]), y[idx]).backward()
            opt.step()
    return net


def weights(path: str) -> list[torch.Tensor]:
    return list(torch.load(path, weights_only=True).values())
