"""Worker functions for tests/test_core_multiproc.py; each runs in every rank of a real gloo group.

Shared with the single-process oracles in the tests: the data, the models and the loop,
so a worker and its oracle differ only in the number of processes.
"""
from __future__ import annotations

import gc
import time
from typing import Any, Callable

import torch
from torch import nn

import phalanx as px
from support.loop import classification, train  # noqa: F401  (the oracles in the tests import it from here)
from support.procs import kill_at

N_SAMPLES, IN, CLASSES = 48, 6, 3


def dataset(n: int = N_SAMPLES) -> torch.utils.data.TensorDataset:
    return classification(n, IN, CLASSES, seed=1234)


def net(seed: int, dropout: float = 0.0) -> nn.Module:
    """A small MLP without BatchNorm (optionally with dropout, for the resume test)."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(IN, 16), nn.Tanh(), nn.Dropout(dropout), nn.Linear(16, CLASSES))


OPTIMIZERS: dict[str, Callable[[Any], torch.optim.Optimizer]] = {
    "sgd": lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9),
    "adam": lambda params: torch.optim.Adam(params, lr=0.01),
}


def flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in px.unwrap(model).parameters()])


def same_everywhere(t: torch.Tensor) -> bool:
    """True when every rank holds exactly this tensor."""
    return all(torch.equal(t, other) for other in px.Comm().all_gather(t))


def equivalence(batch: int, epochs: int, save_path: str) -> dict[str, Any]:
    """Train with SGD-momentum and with Adam; check replicas after every step."""
    try:  # px.wrap before px.init in a 2-worker run must be refused clearly
        px.wrap(net(0), OPTIMIZERS["sgd"](net(0).parameters()))
        wrap_before_init = "no error"
    except px.ConfigError as err:
        wrap_before_init = str(err)
    px.init()
    out: dict[str, Any] = {"wrap_before_init": wrap_before_init}
    try:
        sync_bn = nn.SyncBatchNorm.convert_sync_batchnorm(nn.Sequential(nn.Linear(IN, 4), nn.BatchNorm1d(4)))
        px.wrap(sync_bn, OPTIMIZERS["sgd"](sync_bn.parameters()))
        out["sync_bn_on_cpu"] = "no error"
    except px.ConfigError as err:
        out["sync_bn_on_cpu"] = str(err)
    for name, make_opt in OPTIMIZERS.items():
        model = net(seed=100 + px.rank())  # seeds differ: px.wrap must broadcast rank 0's weights
        before = flat(model)
        out[f"{name}_init_differs"] = not same_everywhere(before)
        out[f"{name}_init"] = {k: v.clone() for k, v in model.state_dict().items()}
        model, opt = px.wrap(model, make_opt(model.parameters()))
        out[f"{name}_init_is_rank0"] = torch.equal(flat(model), px.Comm().all_gather(before)[0])
        agree: list[bool] = []
        loader = px.shard(dataset(), batch_size=batch, shuffle=True, seed=7)
        train(model, opt, loader, epochs,
              on_step=lambda step, model=model, agree=agree: agree.append(same_everywhere(flat(model))))
        out[f"{name}_agree"] = agree
        out[f"{name}_final"] = {k: v.clone() for k, v in px.unwrap(model).state_dict().items()}
    px.save(model, save_path)
    return out


def resume(ckpt: str, phase: str, epochs: int = 3, save_at: int = 7) -> dict[str, torch.Tensor]:
    """phase "first": train all epochs, checkpointing mid-epoch at step ``save_at``; "second": resume from it."""
    px.init()
    model = net(seed=1 if phase == "first" else 99, dropout=0.3)
    torch.manual_seed(500 + px.rank())  # per-rank dropout streams, which the checkpoint must restore
    model, opt = px.wrap(model, OPTIMIZERS["sgd"](model.parameters()))
    loader = px.shard(dataset(), batch_size=4, shuffle=True, seed=11)  # 6 steps per epoch
    start_epoch, step = 0, 0
    if phase == "second":
        step = px.load_checkpoint(ckpt, model, opt, loader=loader)["step"]
        start_epoch = loader.state_dict()["epoch"]

    def checkpoint(now: int) -> None:
        if phase == "first" and now == save_at:
            px.save_checkpoint(ckpt, model, opt, loader=loader, step=now)

    step = train(model, opt, loader, epochs, checkpoint, start_epoch=start_epoch, step=step)
    return {"weights": flat(model), "step": torch.tensor(step)}


def lost_worker(kill_step: int = 3) -> dict[str, Any]:
    """Rank 1 dies at ``kill_step`` of the user's loop; rank 0 reports what it saw and how fast."""
    px.init()
    out: dict[str, Any] = {}
    module = net(0)
    model, opt = px.wrap(module, OPTIMIZERS["sgd"](module.parameters()))
    loader = px.shard(dataset(), batch_size=4)
    started = time.monotonic()
    try:
        train(model, opt, loader, epochs=2, on_step=lambda step: kill_at(kill_step, rank=1, now=step, code=3))
    except Exception as err:  # noqa: BLE001 - reporting whatever surfaced is the point
        out["train"] = {"type": type(err).__name__, "message": str(err)[:2000], "seconds": time.monotonic() - started}
    started = time.monotonic()
    try:  # any later phalanx collective (a barrier, a checkpoint's gather...) names the lost rank
        px.barrier()
    except px.PhalanxError as err:
        out["barrier"] = {"type": type(err).__name__, "message": str(err), "seconds": time.monotonic() - started}
    gc.collect()  # the caught failures' reference cycles: freed now, so the timing below is the leaving alone
    started = time.monotonic()
    px.shutdown()  # what the script's exit does (the runner's own shutdown after this is a no-op)
    out["shutdown_s"] = time.monotonic() - started
    return out
