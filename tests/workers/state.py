"""Worker functions for tests/checkpoint/test_state.py; each runs in every rank of a real gloo group.

Two groups do everything (starting processes is the expensive part): ``first``
trains every strategy without interruption, checkpointing on the way, and runs the
validation scenarios; ``second`` resumes every strategy from those checkpoints in
new processes and runs the uneven-batch scenarios. The rank-0-only save comes last
in ``first``: afterwards the ranks disagree on how many saves they made.
"""
from __future__ import annotations

import os
import random
import time
from typing import Any, Callable

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

import phalanx as px
from support.loop import strategies, take_step
from phalanx.train.callbacks import LambdaCallback
from phalanx.train.trainer import Trainer

IN, CLASSES, N_TRAIN = 6, 3, 48
BATCH, EPOCHS, SAVE_AT = 4, 2, 7  # 6 steps per epoch; step 7 is inside epoch 1 and mid-round for every=4
STRATEGIES: dict[str, Callable[[], px.Strategy]] = strategies(every=4)
IGNORE = -1
CLASS_WEIGHTS = [0.2, 1.0, 3.0]


def dataset(n: int = N_TRAIN, seed: int = 1234, padded: bool = False) -> torch.utils.data.TensorDataset:
    gen = torch.Generator().manual_seed(seed)
    x, y = torch.randn(n, IN, generator=gen), torch.randint(0, CLASSES, (n,), generator=gen)
    if padded:  # a third of the targets are padding
        y[torch.rand(n, generator=gen) < 0.35] = IGNORE
    return torch.utils.data.TensorDataset(x, y)


def net(seed: int, dropout: float = 0.0, batchnorm: bool = False) -> nn.Module:
    torch.manual_seed(seed)
    norm: nn.Module = nn.BatchNorm1d(16) if batchnorm else nn.Identity()
    return nn.Sequential(nn.Linear(IN, 16), norm, nn.Tanh(), nn.Dropout(dropout), nn.Linear(16, CLASSES))


def flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in px.unwrap(model).parameters()]).clone()


def rng_draws() -> list[float]:
    """One draw from each generator the checkpoint must carry per rank."""
    return [random.random(), float(np.random.rand()), float(torch.rand(()))]


def noisy_loop(model: nn.Module, opt: torch.optim.Optimizer, loader: Any, *, step: int, epochs: int,
               on_step: Callable[[int], None] = lambda step: None) -> int:
    """A user loop that draws from Python's, NumPy's and torch's generators every step (augmentation, dropout)."""
    for epoch in range(loader.state_dict()["epoch"], epochs):
        loader.set_epoch(epoch)
        for x, y in loader:
            x = x * (1 + 0.05 * random.random()) + 0.05 * float(np.random.randn()) + 0.05 * torch.randn_like(x)
            take_step(model, opt, x, y)
            step += 1
            on_step(step)
    return step


def seed_everything(base: int) -> None:
    random.seed(base + px.rank())
    np.random.seed(base + px.rank())
    torch.manual_seed(base + px.rank())


def resume_all(tmp: str, phase: str) -> dict[str, Any]:
    """Every strategy: the uninterrupted run (``first``, saving at SAVE_AT) or the run resumed from it (``second``)."""
    out: dict[str, Any] = {}
    for name, make in STRATEGIES.items():
        ckpt = os.path.join(tmp, f"{name}.pt")
        model = net(seed=1 if phase == "first" else 99, dropout=0.3)
        seed_everything(500 if phase == "first" else 900)  # per-rank streams; the resumed run's are wrong on purpose
        model, opt = px.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), strategy=make())
        loader = px.shard(dataset(), batch_size=BATCH, seed=11)
        step = 0
        if phase == "second":
            step = px.load_checkpoint(ckpt, model, opt, loader=loader)["step"]

        def save(now: int, ckpt=ckpt, model=model, opt=opt, loader=loader) -> None:
            if phase == "first" and now == SAVE_AT:
                px.save_checkpoint(ckpt, model, opt, loader=loader, step=now)

        step = noisy_loop(model, opt, loader, step=step, epochs=EPOCHS, on_step=save)
        out[name] = {"weights": flat(model), "steps": step, "rng": rng_draws()}
    return out


def validation() -> dict[str, Any]:
    """Validation of padded and class-weighted losses, a BatchNorm model, and a local strategy mid-training."""
    out: dict[str, Any] = {}
    val = dataset(101, seed=2, padded=True)
    for name, loss_fn in (("ignore_index", nn.CrossEntropyLoss(ignore_index=IGNORE)),
                          ("class_weights", nn.CrossEntropyLoss(weight=torch.tensor(CLASS_WEIGHTS)))):
        model = net(seed=10 + px.rank())  # px.wrap gives every rank rank 0's weights
        t = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), loss_fn, metrics=["accuracy"])
        data = val if name == "ignore_index" else dataset(101, seed=2)
        out[name] = t.evaluate(data, batch_size=16)

    train = dataset(101, seed=3)
    for name, strategy, batchnorm in (("batchnorm", px.AllReduce(), True), ("local", px.LocalSGD(every=100), False)):
        model = net(seed=20, batchnorm=batchnorm)
        states: list[dict[str, torch.Tensor]] = []
        keep = LambdaCallback(on_epoch_end=lambda t, epoch, logs, states=states: states.append(
            {k: v.clone() for k, v in t.module.state_dict().items()}))
        t = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), F.cross_entropy, strategy=strategy,
                    metrics=["accuracy"], callbacks=[keep])
        history = t.fit(train, epochs=2, batch_size=8, val_data=dataset(101, seed=2), val_batch_size=16,
                        progress=False, seed=5)
        out[name] = {"history": list(history), "states": states}
    return out


def rank0_only_save(tmp: str) -> dict[str, Any]:
    """The port's placement: ``if rank == 0: px.save_checkpoint(...)``. Rank 0 must fail fast, saying why."""
    import phalanx.checkpoint.agreement as agreement
    agreement.ENTRY_WAIT_S = 2.0  # the test's patience, not the library's default
    out: dict[str, Any] = {}
    model = net(seed=0)
    model, opt = px.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1))
    if px.rank() == 0:
        started = time.monotonic()
        try:
            px.save_checkpoint(os.path.join(tmp, "rank0.pt"), model, opt)
            out["error"] = None
        except px.PhalanxError as err:
            out["error"] = f"{type(err).__name__}: {err}"
        out["seconds"] = time.monotonic() - started
        out["written"] = os.path.exists(os.path.join(tmp, "rank0.pt"))
    return out


def disk_full(tmp: str) -> dict[str, Any]:
    """Rank 0's disk fills up during a save: every rank must raise, naming the path, none may run on."""
    import resource
    import signal
    model = net(seed=0)
    model, opt = px.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1))
    path = os.path.join(tmp, "full.pt")
    old = resource.getrlimit(resource.RLIMIT_FSIZE)
    if px.rank() == 0:  # writes beyond 4 KiB fail with EFBIG, as on a full disk
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (4096, old[1]))
    try:
        px.save_checkpoint(path, model, opt)
        error = None
    except px.PhalanxError as err:
        error = f"{type(err).__name__}: {err}"
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, old)
    return {"error": error, "path": path, "exists": os.path.exists(path)}


def uneven(tmp: str) -> dict[str, Any]:
    """Short last global batches: 3/2 samples (21 = 8 + 8 + 5) and 1/0 (17 = 8 + 8 + 1, rank 1's part empty)."""
    out: dict[str, Any] = {}
    for n in (21, 17):
        model = net(seed=30)
        model, opt = px.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1))
        loader = px.shard(dataset(n, seed=4), batch_size=BATCH, seed=6)
        sizes = []
        for x, y in loader:
            sizes.append(len(y))
            take_step(model, opt, x, y)
        out[n] = {"weights": flat(model), "sizes": sizes}
    return out


def first(tmp: str) -> dict[str, Any]:
    px.init()
    out = {"resume": resume_all(tmp, "first"), "validation": validation(), "disk_full": disk_full(tmp)}
    out["rank0_only"] = rank0_only_save(tmp)  # last: the ranks' counts of saves differ afterwards
    return out


def slow_peer_save(tmp: str) -> dict[str, Any]:
    """Rank 1 comes to a collective save 11 s after rank 0 (a loaded machine): a slow peer, not a misuse, so the
    save completes (it waits up to the group's timeout); a fixed 10 s patience called this a call on rank 0 only."""
    from phalanx.group import group
    model = net(seed=0)
    model, opt = px.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1))
    if px.rank() == 1:
        from support.wait import until
        store = group.store()
        until(lambda: any(store.check([f"phalanx-entry/save_checkpoint/{n}/0"]) for n in range(1, 8)), timeout=60,
              what="rank 0 in px.save_checkpoint")
        time.sleep(11.0)  # sleep: the slowness under test (longer than the old fixed 10 s patience)
    try:
        px.save_checkpoint(os.path.join(tmp, "slow.pt"), model, opt)
        return {"error": None, "written": os.path.exists(os.path.join(tmp, "slow.pt"))}
    except px.PhalanxError as err:
        return {"error": f"{type(err).__name__}: {err}", "written": False}


def second(tmp: str) -> dict[str, Any]:
    px.init()
    return {"resume": resume_all(tmp, "second"), "uneven": uneven(tmp)}


def slow_peer(tmp: str) -> dict[str, Any]:
    """:func:`slow_peer_save` in a group of its own: the test runs it beside ``first``, so its 11 s wait (the
    slowness under test, idle) overlaps ``first``'s training instead of adding to the suite's time."""
    px.init()
    return {"slow_peer": slow_peer_save(tmp)}
