"""Worker functions for tests/train/test_trainer.py; each runs in every rank of a real gloo group.

The data, models and Trainer settings are shared with the single-process oracles in
the tests, so a worker and its oracle differ only in the number of processes.
"""
from __future__ import annotations

import os
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import phalanx as px
from phalanx.train.callbacks import Callback, LambdaCallback, ModelCheckpoint
from phalanx.train.metrics import Accuracy
from phalanx.train.trainer import Trainer

IN, CLASSES = 6, 3
TRAIN_N, VAL_N = 100, 101  # neither divides by 2 workers x batch 8, and 101 is odd
BATCH, EPOCHS = 8, 3


def dataset(n: int, seed: int) -> torch.utils.data.TensorDataset:
    gen = torch.Generator().manual_seed(seed)
    return torch.utils.data.TensorDataset(torch.randn(n, IN, generator=gen),
                                          torch.randint(0, CLASSES, (n,), generator=gen))


def train_set() -> torch.utils.data.TensorDataset:
    return dataset(TRAIN_N, 1)


def val_set() -> torch.utils.data.TensorDataset:
    return dataset(VAL_N, 2)


def net(seed: int, dropout: float = 0.0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(IN, 32), nn.Tanh(), nn.Dropout(dropout), nn.Linear(32, CLASSES))


def trainer(model: nn.Module, callbacks: list[Callback] | None = None, adam: bool = False) -> Trainer:
    opt = torch.optim.Adam(model.parameters(), lr=0.01) if adam else torch.optim.SGD(model.parameters(), lr=0.1,
                                                                                   momentum=0.9)
    return Trainer(model, opt, F.cross_entropy, metrics=["accuracy", Accuracy(top_k=2)], callbacks=callbacks,
                   warmup_steps=2)


def weights(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in px.unwrap(model).parameters()]).clone()


class Recorder(Callback):
    """Every hook call, in order, as a short string."""

    def __init__(self) -> None:
        self.events: list[str] = []
        self.step_logs: list[dict[str, float]] = []

    def on_train_begin(self, trainer: Trainer) -> None:
        self.events.append("train_begin")

    def on_epoch_begin(self, trainer: Trainer, epoch: int) -> None:
        self.events.append(f"epoch_begin {epoch}")

    def on_step_begin(self, trainer: Trainer, step: int) -> None:
        self.events.append(f"step_begin {step}")

    def on_step_end(self, trainer: Trainer, step: int, logs: dict[str, float]) -> None:
        self.events.append(f"step_end {step}")
        self.step_logs.append(dict(logs))

    def on_epoch_end(self, trainer: Trainer, epoch: int, logs: dict[str, Any]) -> None:
        self.events.append(f"epoch_end {epoch}")

    def on_train_end(self, trainer: Trainer) -> None:
        self.events.append("train_end")


def everything(tmp: str) -> dict[str, Any]:
    """All 2-worker Trainer scenarios in one group (process start-up is the expensive part)."""
    px.init()
    out: dict[str, Any] = {"rank": px.rank()}

    # 1. Exact distributed validation: a fixed model on an uneven set, each rank seeded differently
    #    (px.wrap broadcasts rank 0's weights).
    t = trainer(net(seed=10 + px.rank()))
    out["validation"] = t.evaluate(val_set(), batch_size=16)

    # 2. A fit with callbacks: history keys, hook order, step logs, replicas agreeing.
    rec = Recorder()
    t = trainer(net(seed=0), callbacks=[rec])
    history = t.fit(train_set(), epochs=EPOCHS, batch_size=BATCH, val_data=val_set(), seed=3, progress=False)
    out.update(history=list(history), history_rate=history.samples_per_s, events=rec.events,
               step_logs=rec.step_logs, fit_weights=weights(t.model))

    # 3. Resume: at an epoch boundary (ModelCheckpoint) and mid-epoch (Trainer.save_checkpoint
    #    from on_step_end) equal the uninterrupted run. Dropout and Adam make RNG and optimizer state matter.
    mid = os.path.join(tmp, "mid.pt")
    save_mid = LambdaCallback(on_step_end=lambda tr, step, logs: tr.save_checkpoint(mid) if step == 9 else None)
    full = trainer(net(seed=0, dropout=0.3), [ModelCheckpoint(os.path.join(tmp, "ckpt-{epoch}.pt")), save_mid],
                   adam=True)
    full_history = full.fit(train_set(), epochs=EPOCHS, batch_size=BATCH, val_data=val_set(), seed=3,
                            progress=False)
    out.update(full_weights=weights(full.model), full_history=list(full_history))
    for name, path in (("epoch", os.path.join(tmp, "ckpt-1.pt")), ("mid", mid)):
        resumed = trainer(net(seed=99, dropout=0.3), adam=True)  # different init: the checkpoint must win
        torch.manual_seed(1000 + px.rank())  # and a different RNG state
        h = resumed.fit(train_set(), epochs=EPOCHS, batch_size=BATCH, val_data=val_set(), seed=3,
                        resume_from=path, progress=False)
        out[f"resumed_{name}_weights"] = weights(resumed.model)
        out[f"resumed_{name}_history"] = list(h)
        out[f"resumed_{name}_step"] = resumed.step
    return out
