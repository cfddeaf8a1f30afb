"""Callbacks: code that runs at fixed points of :meth:`phalanx.Trainer.fit`.

Every hook runs on every worker, in this order::

    on_train_begin(trainer)
      on_epoch_begin(trainer, epoch)
        on_step_begin(trainer, step)         # step: 0-based global step index
        on_step_end(trainer, step, logs)     # logs of this worker's step (below)
        ...
      on_epoch_end(trainer, epoch, logs)     # logs: the epoch's history row, same on every worker
    on_train_end(trainer)

The ``epoch`` argument is the 0-based index of the epoch (as ``range(epochs)``
gives it); ``logs["epoch"]`` in the history row counts from 1, as the progress
bar does.

``on_step_end`` logs hold this worker's values for the step:

* ``loss``: the step's loss on this worker's part of the global batch;
* ``batch_size``: samples this worker trained on in the step;
* ``data_s``: seconds waiting for the batch (loading, collating, moving to the device);
* ``forward_backward_s``: forward and backward pass (AllReduce overlaps its
  gradient all-reduce with backward, so that time is in here);
* ``optimizer_s``: ``optimizer.step()`` including the strategy's exchange around it;
* ``step_s``: the three together.

A callback that sets ``trainer.stop_training = True`` ends training after the
current step. Set it from values that are the same on every worker (for example
the epoch logs), or the workers will disagree about when to stop.

Example:
    >>> import phalanx as px
    >>> from phalanx.train.callbacks import Callback
    >>> class PrintLoss(Callback):
    ...     def on_epoch_end(self, trainer, epoch, logs):
    ...         if px.is_main():
    ...             print(epoch, logs["loss"])
"""
from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, Callable

from .. import check
from ..errors import ConfigError, usage

if TYPE_CHECKING:
    from .trainer import Trainer


class Callback:
    """Base class: every hook is a no-op; override the ones you need."""

    def on_train_begin(self, trainer: "Trainer") -> None:
        pass

    def on_epoch_begin(self, trainer: "Trainer", epoch: int) -> None:
        pass

    def on_step_begin(self, trainer: "Trainer", step: int) -> None:
        pass

    def on_step_end(self, trainer: "Trainer", step: int, logs: dict[str, float]) -> None:
        pass

    def on_epoch_end(self, trainer: "Trainer", epoch: int, logs: dict[str, Any]) -> None:
        pass

    def on_train_end(self, trainer: "Trainer") -> None:
        pass


class LambdaCallback(Callback):
    """A callback from plain functions, e.g. ``LambdaCallback(on_epoch_end=lambda t, e, logs: ...)``."""

    HOOKS = ("on_train_begin", "on_epoch_begin", "on_step_begin", "on_step_end", "on_epoch_end", "on_train_end")

    def __init__(self, **hooks: Callable[..., None]) -> None:
        unknown = sorted(set(hooks) - set(self.HOOKS))
        if unknown:
            raise ConfigError(usage(f"LambdaCallback({', '.join(unknown)}=...)", "hooks among " + ", ".join(self.HOOKS),
                                    "Check the hook's name."))
        for name, fn in hooks.items():
            setattr(self, name, fn)


class ModelCheckpoint(Callback):
    """Write a resumable checkpoint every ``every`` epochs; resume with ``fit(resume_from=path)``.

    ``path`` may contain ``{epoch}``, the number of epochs completed, to keep one
    checkpoint per save; otherwise each save replaces the last (atomically). Every
    worker takes part and writes its own part (a DCP directory, see ``px.save_checkpoint``).
    ``blocking=False`` writes it in the background while the next epoch trains; the
    next save and the end of training wait for it.

    Example:
        >>> from phalanx.train.callbacks import ModelCheckpoint
        >>> ModelCheckpoint("ckpt/epoch-{epoch}.pt", every=2)
        ModelCheckpoint('ckpt/epoch-{epoch}.pt', every=2)
    """

    def __init__(self, path: str | os.PathLike, every: int = 1, *, blocking: bool = True) -> None:
        check.positive_int("ModelCheckpoint(every", every, "Pass e.g. every=1 (epochs between saves).", close=")")
        self.path, self.every, self.blocking = os.fspath(path), every, blocking
        self.last_path: str | None = None
        self.pending: Any = None  # the SaveHandle of a save being written in the background

    def on_epoch_end(self, trainer: "Trainer", epoch: int, logs: dict[str, Any]) -> None:
        if (epoch + 1) % self.every == 0:
            self.last_path = self.path.format(epoch=epoch + 1)
            self.pending = trainer.save_checkpoint(self.last_path, blocking=self.blocking)

    def on_train_end(self, trainer: "Trainer") -> None:
        if self.pending is not None:
            self.pending, pending = None, self.pending
            pending.wait()  # fit() returns with its last checkpoint written

    def __repr__(self) -> str:
        tail = "" if self.blocking else ", blocking=False"
        return f"ModelCheckpoint({self.path!r}, every={self.every}{tail})"
