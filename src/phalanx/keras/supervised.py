"""``model.fit`` under ``phalanx run --elastic``: a lost worker is a rollback, not the end of the fit.

``px.init()`` under ``phalanx run --elastic`` puts the elastic feature's supervisor on the group
(:data:`phalanx.train.trainer.SUPERVISOR`, the same one ``px.Trainer.fit(elastic=...)`` uses);
``px.keras.wrap``'s ``fit`` finds it there, so this module never imports ``phalanx.elastic``.
The supervisor commits the training state in memory (weights, Keras optimizer variables, the
strategy, RNG) together with :class:`Position`: the data position of the epoch, the running
state of Keras's metrics and the epoch rows so far.

Commits are taken where a batch begins (every ``commit_every`` steps) and at every epoch end,
after the epoch's collectives (exact metrics, validation) and before the callbacks hear of it.
When a peer is lost the survivors roll back to the newest commit they all hold, the rest of
that epoch is re-split over the new world size (no sample dropped or trained twice), and
Keras's ``fit`` is entered again for the rest of the epoch. One ``fit`` runs per (rest of an)
epoch because Keras fixes the steps of every epoch when ``fit`` starts, and a change of world
size changes them. :class:`Relay` stands between Keras and the user's callbacks so that they
see one fit: ``on_train_begin``/``on_train_end`` once, each epoch's begin and end once, batch
indices counted from the epoch's start. A step redone after a rollback is heard again at
batch level (as ``px.Trainer``'s ``on_step_end``); epoch-level calls and ``history`` equal
plain Keras's run on the same global batches.

Example:
    >>> import numpy as np
    >>> from phalanx.keras.data import shard
    >>> from phalanx.keras.keras_api import keras
    >>> m = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)]); m.compile(optimizer="sgd", loss="mse")
    >>> data = shard(np.zeros((8, 2)), np.zeros(8), batch_size=2, rank=0, world_size=1)
    >>> pos = Position(data, m, ()); pos.state_dict()["data"]
    {'epoch': 0, 'samples': 0, 'steps': 0, 'n': 8}
"""
from __future__ import annotations

from typing import Any, Callable, Protocol, runtime_checkable

import torch

from ..group import group
from .callbacks import WRITERS
from .keras_api import keras
from .metrics import leaves


@runtime_checkable
class Commits(Protocol):
    """A supervisor that can commit now (``px.elastic.State.commit``): used at every epoch end."""

    def commit(self) -> None: ...


class _Handle:
    def __init__(self, hooks: list[Callable[[], None]], fn: Callable[[], None]) -> None:
        self.hooks, self.fn = hooks, fn

    def remove(self) -> None:
        if self.fn in self.hooks:
            self.hooks.remove(self.fn)


class Position:
    """What a commit holds of a Keras fit besides the weights: where the data stands, the metrics' running
    state, and the epoch rows; handed to the supervisor as its ``loader``.

    It offers what the supervisor asks of a loader: ``state_dict``/``load_state_dict``, ``before_batch(fn)``
    (the commit point, called where a batch begins) and ``sampler`` with ``epoch`` and ``reassign``.
    """

    def __init__(self, data: Any, model: Any, others: Any, comm: Any = None, steps: Callable[[], int] = lambda: 0,
                 commit_every: int = 1) -> None:
        self.data, self.model, self.others = data, model, [d for d in others if hasattr(d, "reassign")]
        self.comm, self.steps, self.commit_every = comm, steps, commit_every
        # The metrics' running state summed over the world where a commit is due: a lost worker's part of the
        # epoch so far is then not lost with it (each worker's own state is summed only at the epoch's end).
        self._world: list[torch.Tensor] | None = None
        self._world_at, self._last = -1, 0
        self.rows: list[dict[str, float]] = []  # one per epoch ended, rolled back with the commit
        self.commit: Callable[[], None] | None = None
        self._hooks: list[Callable[[], None]] = []
        self._pending: list[torch.Tensor] | None = None  # the metrics' state a rollback left, set at epoch begin

    # -- what the supervisor reads ---------------------------------------------------------------------------
    @property
    def sampler(self) -> "Position":
        return self

    @property
    def epoch(self) -> int:
        return int(self.data.epoch)

    def reassign(self, rank: int, world_size: int) -> None:
        """After a regroup: the rest of the epoch over the new world; validation data split over it too."""
        for data in (self.data, *self.others):
            data.reassign(rank, world_size)

    def before_batch(self, fn: Callable[[], None]) -> _Handle:
        self._hooks.append(fn)
        return _Handle(self._hooks, fn)

    def state_dict(self) -> dict[str, Any]:
        now = self._last = self.steps()
        summed = self._world is not None and self._world_at == now
        metrics = self._world if summed else [v.value.detach().cpu().clone() for v in self._metric_variables()]
        return {"data": self.data.state_dict(), "rows": [dict(r) for r in self.rows], "metrics": metrics,
                "metrics_summed": summed}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.data.load_state_dict(state["data"])
        self.rows = [dict(r) for r in state["rows"]]
        self._pending = list(state["metrics"])
        if state.get("metrics_summed") and group.rank() != 0:  # the world's sum goes to one worker of the new world
            self._pending = [torch.zeros_like(t) for t in self._pending]

    # -- what px.keras's EpochSync calls ---------------------------------------------------------------------
    def epoch_begins(self) -> None:
        """After Keras reset the metrics: a fit resumed mid-epoch takes back their state at the commit."""
        pending, self._pending = self._pending, None
        variables = self._metric_variables()
        if pending is not None and self.data.step_in_epoch > 0 and len(pending) == len(variables):
            for v, saved in zip(variables, pending, strict=True):
                v.assign(saved.to(v.value.device))

    def batch_begins(self, step: int) -> None:
        """Between two steps: the commit point (may raise the supervisor's membership change)."""
        self.data.begin(step)
        if self._hooks and self.comm is not None and self.steps() - self._last >= self.commit_every:
            self._world, self._world_at = self._summed(), self.steps()  # a commit is due here
        for hook in list(self._hooks):
            hook()

    def epoch_ends(self, logs: dict[str, Any] | None) -> None:
        """The epoch's collectives are done: note its row and commit, before any callback hears of it."""
        self.data.finish_epoch()
        self.rows.append({k: float(v) for k, v in (logs or {}).items()})
        if self.commit is not None:
            self.commit()

    def resuming(self) -> None:
        """Before Keras's fit is entered again mid-epoch without a rollback (joiners were admitted): Keras resets
        the metrics at the epoch's begin, so their live state is kept to be put back (:meth:`epoch_begins`)."""
        if self._pending is None and self.data.step_in_epoch > 0:
            self._pending = [v.value.detach().cpu().clone() for v in self._metric_variables()]

    def next_epoch(self) -> None:
        self._pending = None
        self.data.set_epoch(self.data.epoch + 1)

    def _summed(self) -> list[torch.Tensor]:
        """The metrics' state summed over every worker (collective: one all-reduce of a few numbers)."""
        local = [v.value.detach().cpu().clone() for v in self._metric_variables()]
        if not local or self.comm.world_size == 1:
            return local
        flat = torch.cat([t.reshape(-1).to(torch.float64) for t in local])
        self.comm.all_reduce_([flat], op="sum")
        out, offset = [], 0
        for t in local:
            out.append(flat[offset:offset + t.numel()].reshape(t.shape).to(t.dtype))
            offset += t.numel()
        return out

    def _metric_variables(self) -> list[Any]:
        # the leaves: Keras's compile_metrics container lists none of its metrics' variables as its own
        return [v for m in leaves(list(self.model.metrics)) for v in m.variables]


class Relay(keras.callbacks.Callback):
    """The user's callbacks behind one callback, so that several Keras fits look like one to them."""

    def __init__(self, callbacks: list[Any], data: Any) -> None:
        super().__init__()
        self.callbacks, self.data = list(callbacks), data
        self.stop_requested = False
        # what this worker's callbacks already heard (not rolled back: they cannot unhear it)
        self._began = False
        self._started: set[int] = set()
        self._epochs_begun: set[int] = set()
        self._epochs_ended: set[int] = set()

    def set_model(self, model: Any) -> None:
        super().set_model(model)
        for c in self.callbacks:
            c.set_model(model)

    def set_params(self, params: Any) -> None:
        super().set_params(params)
        for c in self.callbacks:
            c.set_params(params)

    def _all(self, hook: str, *args: Any) -> None:
        for c in self.callbacks:
            if isinstance(c, WRITERS) and not group.is_main():
                continue  # each file written once, by whichever worker is main now (rank 0 may have been lost)
            if hook != "on_train_begin" and id(c) not in self._started:
                self._started.add(id(c))  # a writer on a worker that became main: its train begins now
                c.on_train_begin()
            if hook == "on_train_begin":
                self._started.add(id(c))
            getattr(c, hook)(*args)

    def on_train_begin(self, logs: Any = None) -> None:
        if not self._began:
            self._began = True
            self._all("on_train_begin", logs)

    def on_train_end(self, logs: Any = None) -> None:
        pass  # once, by end()

    def end(self, logs: Any = None) -> None:
        self._all("on_train_end", logs)

    def on_epoch_begin(self, epoch: int, logs: Any = None) -> None:
        if epoch not in self._epochs_begun:
            self._epochs_begun.add(epoch)
            self._all("on_epoch_begin", epoch, logs)

    def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
        if epoch not in self._epochs_ended:
            self._epochs_ended.add(epoch)
            self._all("on_epoch_end", epoch, logs)
        self.stop_requested = bool(self.model.stop_training)

    # batch indices from the epoch's start, as one uninterrupted fit counts them
    def on_train_batch_begin(self, batch: int, logs: Any = None) -> None:
        self._all("on_train_batch_begin", batch + self.data.first_step, logs)

    def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
        self._all("on_train_batch_end", batch + self.data.first_step, logs)

    def on_test_begin(self, logs: Any = None) -> None:
        self._all("on_test_begin", logs)

    def on_test_end(self, logs: Any = None) -> None:
        self._all("on_test_end", logs)

    def on_test_batch_begin(self, batch: int, logs: Any = None) -> None:
        self._all("on_test_batch_begin", batch, logs)

    def on_test_batch_end(self, batch: int, logs: Any = None) -> None:
        self._all("on_test_batch_end", batch, logs)


def agree(comm: Any, flag: bool) -> bool:
    """Whether any worker asked to stop (collective)."""
    if comm.world_size == 1:
        return flag
    t = torch.tensor([1.0 if flag else 0.0])
    comm.all_reduce_([t], op="sum")
    return bool(t.item() > 0)


def fit_supervised(supervisor: Any, run: Any, x: Any, y: Any, kwargs: dict[str, Any], user_callbacks: list[Any],
                   make_callbacks: Callable[[Position, Relay], list[Any]], commit_every: int) -> Any:
    """``fit`` under the elastic supervisor: one Keras fit per (rest of an) epoch, re-entered after a loss.

    Returns a ``keras.callbacks.History`` of the whole fit; its ``membership`` lists every change.
    """
    model = run.model
    epochs, initial = int(kwargs.pop("epochs", 1)), int(kwargs.pop("initial_epoch", 0) or 0)
    position = Position(x, model, [kwargs.get("validation_data")], run.comm, lambda: int(run.strategy.steps),
                        commit_every)
    relay = Relay(user_callbacks, x)
    if initial:
        x.set_epoch(initial)
    state = supervisor(model, run.optimizer_state, position, commit_every=commit_every, resize=None)
    if isinstance(state, Commits):
        position.commit = state.commit
    callbacks = make_callbacks(position, relay)

    def attempt(_state: Any) -> None:  # entered again at the commit after every membership change
        while True:
            if x.epoch_done:
                if agree(run.comm, relay.stop_requested) or x.epoch + 1 >= epochs:
                    return
                position.next_epoch()
            position.resuming()
            epoch = x.epoch
            type(model).fit(model, x, y, epochs=epoch + 1, initial_epoch=epoch, callbacks=callbacks, **kwargs)

    if epochs > initial:
        state.supervise(attempt)
    run.strategy.finish()  # drifting replicas (LocalSGD, DiLoCo, EASGD) end holding one model
    history = keras.callbacks.History()
    history.set_model(model)
    history.epoch = list(range(initial, initial + len(position.rows)))
    for row in position.rows:
        for key, value in row.items():
            history.history.setdefault(key, []).append(value)
    history.membership = list(getattr(state, "history", []))
    relay.end(position.rows[-1] if position.rows else {})
    model.history = history
    return history
