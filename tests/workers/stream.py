"""Worker functions for tests/stream/test_stream_multiproc.py: the user's loop over a live Redis stream.

Every rank appends one line per step to ``<log_dir>/inc<incarnation>.rank<rank>.log``:
``step weight id id ...`` (the ids it trained on). A test rebuilds the final model's
history from those lines and the step each incarnation resumed from.
"""
from __future__ import annotations

import os
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import phalanx as px
from phalanx.stream import Deadline, RedisStream, Stop, StreamLoader, WaitFull, decode_sample
from support.procs import kill_at


def net(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3))


def flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in px.unwrap(model).parameters()])


def train(url: str, stream: str, group: str, *, batch_size: int, ckpt: str, log_dir: str, incarnation: int = 0,
          every: int = 5, kill_step: int | None = None, kill_rank: int | None = None, deadline_s: float | None = None,
          idle_s: float = 30.0, lr: float = 0.1) -> dict[str, Any]:
    """Train from the stream, checkpointing every ``every`` steps; resume from ``ckpt`` if it exists.

    ``kill_rank=-1`` kills every rank at ``kill_step`` (a full crash).
    """
    px.init()
    model = net()
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    model, opt = px.wrap(model, opt)
    source = RedisStream(url, stream=stream, group=group, decode=decode_sample, create=True)
    policy = WaitFull() if deadline_s is None else Deadline(deadline_s)
    loader = StreamLoader(source, batch_size, policy=policy, stop=Stop(idle_s=idle_s), block_s=0.1)
    resumed = 0
    if os.path.exists(ckpt):  # the loader's state is world-size independent: it restores even if -n changed
        resumed = int(px.load_checkpoint(ckpt, model, opt, loader=loader)["step"])
    log = open(os.path.join(log_dir, f"inc{incarnation}.rank{px.rank()}.log"), "a")
    for x, y in loader:
        step = loader.steps
        if kill_step is not None:
            kill_at(kill_step, rank=px.rank() if kill_rank == -1 else kill_rank, now=step)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
        log.write(f"{step} {loader.batch_weight:.6f} {' '.join(loader.ids)}\n")
        log.flush()
        if step % every == 0:
            px.save_checkpoint(ckpt, model, opt, loader=loader, step=step)
    px.save_checkpoint(ckpt, model, opt, loader=loader, step=loader.steps)  # the final commit
    loader.close()  # acknowledge it: nothing stays pending
    log.close()
    return {"params": flat(model), "steps": loader.steps, "resumed": resumed,
            "pending": source.pending() if px.is_main() else -1, "dead": loader.dead}
