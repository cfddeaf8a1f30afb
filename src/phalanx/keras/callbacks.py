"""Callbacks that keep the workers of a wrapped Keras model in step.

``px.keras.wrap``'s ``fit`` adds :class:`EpochSync` first and :class:`StopTogether`
last to the user's list, and on every worker but the main one drops the callbacks
that write files (``ModelCheckpoint``, ``CSVLogger``, ``TensorBoard``), so each file
is written once. Epoch-end logs are exact and identical on every worker, so
``EarlyStopping`` decides the same everywhere; :class:`StopTogether` makes that a
guarantee for any callback (a worker that stops alone would leave its peers waiting).

Example:
    >>> from phalanx.keras.keras_api import keras
    >>> [type(c).__name__ for c in main_only([keras.callbacks.CSVLogger("log.csv"), keras.callbacks.History()],
    ...                                       is_main=False)]
    ['History']
"""
from __future__ import annotations

from typing import Any

import torch

from ..group.collectives import Comm
from ..step.clock import set_batch_weight
from .keras_api import keras

WRITERS = tuple(c for c in (getattr(keras.callbacks, n, None) for n in ("ModelCheckpoint", "CSVLogger", "TensorBoard"))
                if isinstance(c, type))


def main_only(callbacks: list[Any], *, is_main: bool) -> list[Any]:
    """The callbacks this worker runs: all of them on the main worker, the non-writers elsewhere."""
    return list(callbacks) if is_main else [c for c in callbacks if not isinstance(c, WRITERS)]


class EpochSync(keras.callbacks.Callback):
    """Tells sharded datasets the epoch (their shuffle) and the loader's batch weight before each step."""

    def __init__(self, train: Any, *others: Any, position: Any = None) -> None:
        super().__init__()
        self.train, self.others = train, [d for d in others if d is not None]
        self.position = position  # an elastic fit's (phalanx.keras.supervised.Position): commits and rollbacks
        if hasattr(train, "keep_short_tail"):
            train.keep_short_tail()  # a tail smaller than the workers is its own step, as in plain Keras
        self._saved: list[tuple[Any, Any]] | None = None

    def on_epoch_begin(self, epoch: int, logs: Any = None) -> None:
        for data in (self.train, *self.others):
            if hasattr(data, "set_epoch"):
                data.set_epoch(epoch)
        if self.position is not None:
            self.position.epoch_begins()

    def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
        if self.position is not None:  # first of the callbacks: the commit precedes what the others hear
            self.position.epoch_ends(logs)

    def on_train_batch_begin(self, batch: int, logs: Any = None) -> None:
        if self.position is not None:
            self.position.batch_begins(batch)
        if hasattr(self.train, "batch_weight"):
            weight = self.train.batch_weight(batch)
            set_batch_weight(weight)
            if weight == 0:  # a stand-in for an empty part: it must count in no metric (loss, accuracy...)
                self._saved = [(v, v.numpy()) for m in self.model.metrics for v in m.variables]

    def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
        if self._saved is not None:
            for variable, value in self._saved:
                variable.assign(value)
            self._saved = None

    def on_train_end(self, logs: Any = None) -> None:
        set_batch_weight(1.0)


class StopTogether(keras.callbacks.Callback):
    """Every worker stops when any worker's callbacks asked to (one tiny all-reduce per check).

    Checked at each epoch end, and after each batch only when a user callback may stop
    mid-epoch (it overrides a batch-end hook, as ``TerminateOnNaN`` does).
    """

    def __init__(self, comm: Comm, *, every_batch: bool, at_epoch_end: bool = True) -> None:
        super().__init__()
        self.comm, self.every_batch, self.at_epoch_end = comm, every_batch, at_epoch_end
        self.async_safe = not every_batch  # then the batch hook does nothing, so Keras may run it on a thread

    def _agree(self) -> None:
        if self.comm.world_size == 1:
            return
        flag = torch.tensor([1.0 if self.model.stop_training else 0.0])
        self.comm.all_reduce_([flag], op="sum")
        self.model.stop_training = bool(flag.item() > 0)

    def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
        if self.every_batch:
            self._agree()

    def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
        if self.at_epoch_end:  # an elastic fit agrees after the epoch's commit instead (phalanx.keras.supervised)
            self._agree()


def stops_mid_epoch(callbacks: list[Any]) -> bool:
    """Whether a callback overrides a batch-end hook (and so might set ``stop_training`` mid-epoch)."""
    base = keras.callbacks.Callback
    quiet = (keras.callbacks.History, keras.callbacks.ProgbarLogger, *WRITERS)
    return any(not isinstance(c, quiet) and (type(c).on_train_batch_end is not base.on_train_batch_end
                                             or type(c).on_batch_end is not base.on_batch_end)
               for c in callbacks)
