"""Worker functions for tests/test_gpu.py: real processes on the GPU (gloo between two of them on one GPU,
since NCCL refuses two ranks on one device), and a group of one on NCCL."""
from __future__ import annotations

import os
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import phalanx as px

N, IN, CLASSES = 64, 16, 4
AMP = {"fp32": (None, False), "bf16": (torch.bfloat16, False), "fp16": (torch.float16, True)}


def dataset() -> torch.utils.data.TensorDataset:
    gen = torch.Generator().manual_seed(7)
    return torch.utils.data.TensorDataset(torch.randn(N, IN, generator=gen),
                                          torch.randint(0, CLASSES, (N,), generator=gen))


def net(seed: int = 0, dropout: float = 0.0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(IN, 32), nn.Tanh(), nn.Dropout(dropout), nn.Linear(32, CLASSES))


def flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in px.unwrap(model).parameters()]).float().cpu()


def train(model: nn.Module, opt: torch.optim.Optimizer, loader: Any, steps: int, amp: str = "fp32",
          scaler: torch.amp.GradScaler | None = None, poison: tuple[int, int] | None = None) -> list[float]:
    """The README loop with autocast (and a GradScaler for fp16); ``poison=(rank, step)`` makes that rank's
    loss infinite at that step, as an fp16 overflow would."""
    dtype, _ = AMP[amp]
    losses, step = [], 0
    epoch = 0
    while step < steps:
        loader.set_epoch(epoch)
        for x, y in loader:
            opt.zero_grad(set_to_none=True)
            with torch.autocast("cuda", dtype=dtype or torch.float32, enabled=dtype is not None):
                loss = F.cross_entropy(model(x).float(), y)
            if poison is not None and poison == (px.rank(), step):
                loss = loss * float("inf")
            if scaler is not None:
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
            else:
                loss.backward()
                opt.step()
            losses.append(float(loss))
            step += 1
            if step == steps:
                break
        epoch += 1
    return losses


def amp_strategies(names: list[str], amps: list[str], steps: int = 6, batch: int = 8) -> dict[str, Any]:
    """Each (strategy, precision) on this rank: a fresh model trained ``steps`` steps; final params and losses."""
    px.init(backend="gloo")
    out: dict[str, Any] = {"device": str(px.device())}
    for name in names:
        for amp in amps:
            model = net(seed=px.rank())  # different seeds: the strategy's broadcast makes replicas equal
            opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
            model, opt = px.wrap(model, opt, strategy=name)
            loader = px.shard(dataset(), batch_size=batch, shuffle=True, seed=0, device=px.device())
            scaler = torch.amp.GradScaler("cuda") if AMP[amp][1] else None
            losses = train(model, opt, loader, steps, amp, scaler)
            strategy = px.strategy_of(opt)
            if hasattr(strategy, "finish"):
                strategy.finish()
            out[f"{name}/{amp}"] = {"params": flat(model), "losses": losses, "on": str(next(model.parameters()).device)}
    return out


def skipped_step(name: str, steps: int = 4, batch: int = 8) -> dict[str, Any]:
    """fp16 + GradScaler with rank 1's loss infinite at step 1: what each rank does with the skipped step."""
    px.init(backend="gloo")
    model = net(seed=0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = px.wrap(model, opt, strategy=name)
    loader = px.shard(dataset(), batch_size=batch, shuffle=False, device=px.device())
    scaler = torch.amp.GradScaler("cuda")
    losses = train(model, opt, loader, steps, "fp16", scaler, poison=(1, 1))
    strategy = px.strategy_of(opt)
    return {"params": flat(model), "losses": losses, "scale": scaler.get_scale(),
            "strategy_steps": int(getattr(strategy, "steps", -1))}


def two_on_one_gpu(batch: int, steps: int, path: str | None = None, resume: bool = False, dropout: float = 0.0,
                   cuda_seed_per_rank: bool = False, adam: bool = False) -> dict[str, Any]:
    """AllReduce over gloo with the model on the GPU; with ``path``: checkpoint at ``steps`` and go on (or resume)."""
    px.init(backend="gloo")
    model = net(seed=0, dropout=dropout)
    if cuda_seed_per_rank:  # dropout masks on the GPU then differ between ranks, as in real runs
        torch.cuda.manual_seed(100 + px.rank())
    # SGD for the oracle: Adam is nearly blind to the gradient's scale, so a wrong average would pass
    opt = torch.optim.Adam(model.parameters(), lr=0.01) if adam else torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = px.wrap(model, opt)
    loader = px.shard(dataset(), batch_size=batch, shuffle=True, seed=3, device=px.device())
    if resume:
        px.load_checkpoint(path, model, opt, loader=loader)
        train(model, opt, loader, steps)
        return {"params": flat(model), "device": str(px.device())}
    train(model, opt, loader, steps)
    if path is None:
        return {"params": flat(model), "device": str(px.device())}
    px.save_checkpoint(path, model, opt, loader=loader, step=steps)
    train(model, opt, loader, steps)
    return {"params": flat(model), "device": str(px.device())}


def nccl_group_of_one() -> dict[str, Any]:
    """A 1-rank NCCL process group, and the collectives phalanx issues: CUDA tensors (DDP, broadcast at wrap)
    and the CPU tensors of the checkpoint gather (RNG states, pickled state)."""
    import torch.distributed as dist

    dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    torch.cuda.set_device(dev)
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=dev)
    out: dict[str, Any] = {"backend": dist.get_backend()}
    t = torch.arange(4.0, device=dev)
    dist.broadcast(t, 0)
    dist.all_reduce(t)
    out["cuda_all_reduce"] = t.cpu()
    try:
        got = [torch.empty_like(torch.get_rng_state())]
        dist.all_gather(got, torch.get_rng_state())
        out["cpu_all_gather"] = "ok"
    except Exception as err:  # noqa: BLE001 - recorded for the report
        out["cpu_all_gather"] = str(err).splitlines()[0][:200]
    dist.destroy_process_group()
    dist.init_process_group("cpu:gloo,cuda:nccl", rank=0, world_size=1, device_id=dev)
    got = [torch.empty_like(torch.get_rng_state())]
    dist.all_gather(got, torch.get_rng_state())
    t = torch.ones(3, device=dev)
    dist.all_reduce(t)
    out["mixed_cpu_all_gather"] = torch.equal(got[0], torch.get_rng_state())
    out["mixed_cuda_all_reduce"] = t.cpu()
    dist.destroy_process_group()
    return out
