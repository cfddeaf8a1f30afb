"""A Keras callback that measures training throughput, warm-up epochs and validation excluded.

Example:
    >>> meter = Throughput(samples_per_epoch=1000)
    >>> meter.global_rate() != meter.global_rate()  # nan before any timed epoch
    True
"""
from __future__ import annotations

import math
import time
from typing import Any

import torch

from ..group import group
from ..train.metrics import reduce_all
from .keras_api import keras


class Throughput(keras.callbacks.Callback):
    """Training samples per second over the epochs after ``warmup_epochs`` (all workers together).

    ``samples_per_epoch`` is the whole training set (every worker's shard together).
    """

    def __init__(self, samples_per_epoch: int, warmup_epochs: int = 1) -> None:
        super().__init__()
        self.samples_per_epoch, self.warmup_epochs = samples_per_epoch, warmup_epochs
        self.epochs, self.seconds = 0, 0.0
        self._start: float = 0.0
        self._train_end: float | None = None

    def on_epoch_begin(self, epoch: int, logs: Any = None) -> None:
        self._start, self._train_end = time.perf_counter(), None

    def on_test_begin(self, logs: Any = None) -> None:
        if self._train_end is None:  # validation inside fit: training time for this epoch ends here
            self._train_end = time.perf_counter()

    def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
        end = self._train_end if self._train_end is not None else time.perf_counter()
        if epoch >= self.warmup_epochs:
            self.epochs += 1
            self.seconds += end - self._start

    def global_rate(self) -> float:
        """Samples per second of all workers (collective in a group: each worker's mean time)."""
        seconds = reduce_all([], None, extra=torch.tensor([self.seconds])).item() / group.world_size()
        return self.epochs * self.samples_per_epoch / seconds if seconds > 0 else math.nan
