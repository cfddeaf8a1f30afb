"""Worker functions for tests/checkpoint/test_dcp.py: DCP checkpoints written and read by real gloo groups.

``train`` runs the user's loop (AdamW, AllReduce) over ``px.shard`` data with a fixed
global batch, saving at ``SAVE_AT`` or resuming from a checkpoint; the test compares it
with one process over the same global batches. ``sharded`` saves a model sharded with
torch's own ``fully_shard``; ``killed`` holds an asynchronous save half-way through its
write (a storage writer, in the writer process, that holds until killed) and kills every worker with SIGKILL.
"""
from __future__ import annotations

import os
import signal
from typing import Any

import torch
from torch import nn

import phalanx as px
from support.loop import take_step

IN, HIDDEN, CLASSES, N = 6, 12, 3, 48
GLOBAL_BATCH, STEPS, SAVE_AT = 12, 8, 3  # 4 steps per epoch; step 3 is inside epoch 0; 12 = 2 x 6 = 3 x 4


def dataset() -> torch.utils.data.TensorDataset:
    gen = torch.Generator().manual_seed(1234)
    return torch.utils.data.TensorDataset(torch.randn(N, IN, generator=gen), torch.randint(0, CLASSES, (N,),
                                                                                          generator=gen))


def net(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(IN, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, CLASSES))


def optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1)


def flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in px.unwrap(model).parameters()]).clone()


def loop(model: nn.Module, opt: torch.optim.Optimizer, loader: Any, step: int, until: int,
         on_step: Any = lambda step: None) -> int:
    """The user's loop, by global step: ``until`` steps in all, whatever the step it starts from."""
    while step < until:
        loader.set_epoch(loader.state_dict()["epoch"])
        for x, y in loader:
            take_step(model, opt, x, y)
            step += 1
            on_step(step)
            if step == until:
                break
        else:
            loader.set_epoch(loader.state_dict()["epoch"] + 1)
    return step


def oracle(until: int = STEPS) -> torch.Tensor:
    """One process, the whole global batch, plain torch: the weights after ``until`` steps."""
    model = net(seed=1)
    opt = optimizer(model)
    loader = px.shard(dataset(), batch_size=GLOBAL_BATCH, seed=7, rank=0, world_size=1)
    loop(model, opt, loader, 0, until)
    return flat(model)


def train(ckpt: str, resume: bool) -> dict[str, Any]:
    """Save at SAVE_AT and go on to STEPS (``resume=False``), or resume from ``ckpt`` and go on to STEPS."""
    px.init()
    model, opt = _wrapped(99 if resume else 1)  # a resumed run starts from other weights: the checkpoint must win
    loader = px.shard(dataset(), batch_size=GLOBAL_BATCH // px.world_size(), seed=7)
    step = px.load_checkpoint(ckpt, model, opt, loader=loader)["step"] if resume else 0
    at_load = flat(model)

    def save(now: int) -> None:
        if not resume and now == SAVE_AT:
            px.save_checkpoint(ckpt, model, opt, loader=loader, step=now)

    step = loop(model, opt, loader, step, STEPS, save)
    return {"weights": flat(model), "steps": step, "at_load": at_load}


def _wrapped(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    model = net(seed)
    return px.wrap(model, optimizer(model), strategy=px.AllReduce())


def sharded(ckpt: str, mesh: list[int], load: bool, asynchronous: bool = False) -> dict[str, Any]:
    """A model sharded by torch's ``fully_shard`` over ``mesh`` (replicas x shards: [2, 2] is HSDP, [2] is FSDP).

    ``load=False``: train SAVE_AT steps and save (``asynchronous``: from the writer process, each worker staging
    its shards). ``load=True``: resume from ``ckpt`` (written on another mesh) and train on to STEPS. Reports each
    parameter whole, and how much of it this worker held.
    """
    px.init()
    return _sharded_run(ckpt, mesh, load, asynchronous)


def reloaded(ckpt: str, meshes: list[list[int]]) -> list[dict[str, Any]]:
    """One group of workers resumes ``ckpt`` once per mesh in ``meshes`` (e.g. [1, 3] then [3, 1]), each time into
    a fresh model sharded over that mesh, and trains on to STEPS: several reshards for one start-up."""
    px.init()
    return [_sharded_run(ckpt, mesh, True) for mesh in meshes]


def _sharded_run(ckpt: str, mesh: list[int], load: bool, asynchronous: bool = False) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    model = net(seed=99 if load else 1)
    device_mesh = init_device_mesh("cpu", tuple(mesh), mesh_dim_names=("replicate", "shard")[-len(mesh):])
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=device_mesh)
    fully_shard(model, mesh=device_mesh)
    opt = optimizer(model)
    loader = px.shard(dataset(), batch_size=GLOBAL_BATCH // px.world_size(), seed=7)
    step = px.load_checkpoint(ckpt, model, opt, loader=loader)["step"] if load else 0
    at_load = {name: p.full_tensor().detach().clone() for name, p in model.named_parameters()}

    def save(now: int) -> None:
        if not load and now == SAVE_AT:
            handle = px.save_checkpoint(ckpt, model, opt, loader=loader, step=now, blocking=not asynchronous)
            if handle is not None:
                handle.wait()

    # fully_shard averages gradients over every worker: each one's mean over its part makes the global mean
    step = loop(model, opt, loader, step, STEPS if load else SAVE_AT, save)
    return {"shards": {name: p.to_local().numel() for name, p in model.named_parameters()},
            "at_load": at_load, "steps": step,
            "full": torch.cat([p.full_tensor().detach().reshape(-1) for p in model.parameters()]),
            "files": sorted(os.listdir(ckpt))}


def killed(ckpt: str) -> dict[str, Any]:
    """Save (blocking) at step 2; start an asynchronous save at step 4, train on while its writer process holds it
    half-way through its write (saying so in ``<ckpt>-held-<rank>.json``), then every worker kills itself with
    SIGKILL. The test then loads ``ckpt``, and checks that the writer processes ended with their workers."""
    import phalanx.checkpoint.saver as saver
    from support.wait import until
    from workers.writer_hooks import CutWriter
    g = px.init()
    store = g.store
    held = f"{ckpt}-held-{px.rank()}.json"

    model, opt = _wrapped(1)
    loader = px.shard(dataset(), batch_size=GLOBAL_BATCH // px.world_size(), seed=7)
    loop(model, opt, loader, 0, 2)
    px.save_checkpoint(ckpt, model, opt, loader=loader, step=2)
    saved = flat(model)
    torch.save(saved, f"{ckpt}-weights-{px.rank()}.pt")
    loop(model, opt, loader, 2, 4)
    saver._writer = lambda tmp: CutWriter(tmp, held=held, rank=px.rank())  # the test's hook into DCP's writer
    handle = px.save_checkpoint(ckpt, model, opt, loader=loader, step=4, blocking=False)
    loop(model, opt, loader, 4, 6)  # training goes on while the checkpoint is being written
    until(lambda: os.path.exists(held), timeout=60, what="the writer process holding the write half-way")
    store.set(f"held/{px.rank()}", "1")
    store.wait([f"held/{r}" for r in range(px.world_size())])  # every worker is half-way through its write
    torch.save({"done": handle.done(), "trained": flat(model)}, f"{ckpt}-held-{px.rank()}.pt")
    # Rank 0 hosts the store, so it dies last: a peer is done with the store once its "killing" key is set, and a
    # store call of a peer cut off by the host's death would end that peer with an error instead of SIGKILL.
    store.set(f"killing/{px.rank()}", "1")
    if px.rank() == 0:
        store.wait([f"killing/{r}" for r in range(px.world_size())])
    os.kill(os.getpid(), signal.SIGKILL)
    return {}
