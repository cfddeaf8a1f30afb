"""Experiment tracking: loss, metrics, lr, samples/s, bytes sent, world size and membership changes, logged
where users look (TensorBoard, MLflow, Weights & Biases), from the main worker only.

One object serves both loops. In your own loop::

    tracker = px.Tracker("tensorboard", "runs/exp1", optimizer=opt)   # every worker builds it; rank 0 writes
    for step, (x, y) in enumerate(loader):
        ...
        tracker.log(step, loss=loss.item(), batch_size=len(x))
    tracker.close()

With the Trainer it is a callback: ``Trainer(..., callbacks=[px.Tracker("mlflow", "mlruns")])``
logs every step's loss, lr, samples/s and bytes, and every epoch's history row
(validation metrics included).

Each ``log`` adds, without being asked: ``world_size``; ``lr`` and ``bytes_sent``
(this worker's payload bytes so far, :class:`~phalanx.group.collectives.CommStats`) when the
tracker knows the optimizer; ``samples_per_s`` (global) when ``batch_size`` is
given. Every membership change of an elastic run (``Group.on_regroup``) is
written at the next ``log``: the generation, the world size before and after, the
last step logged before it, the first step after it (a rollback redoes the steps
between) and the wall time between those two logs (what the change cost). Given
``elastic=state`` (a ``px.elastic.State``), it also names who left and who joined.
If rank 0 itself is lost, the new rank 0 opens the back end afresh: TensorBoard then
has a second event file in the same directory (one run), MLflow and W&B a second run.

Back ends are objects (:class:`TensorBoard`, :class:`MLflow`, :class:`WandB`; or your own with
``scalars``/``text``/``params``/``close``); a name picks one with its defaults.
A missing extra or an unknown name is a :class:`~phalanx.errors.ConfigError` when
the tracker is built, on every worker. A problem only in logging (a directory that
cannot be written, a full disk) warns once and logging stops; training goes on.
Weights & Biases (:class:`WandB`, extra ``phalanx[wandb]``) writes offline by
default: nothing leaves the machine until ``wandb sync``.

Example:
    >>> import tempfile, phalanx as px
    >>> tracker = px.Tracker("tensorboard", tempfile.mkdtemp())   # doctest: +SKIP
    >>> tracker.log(0, loss=2.3)                                  # doctest: +SKIP
"""
from __future__ import annotations

import importlib.util
import os
import time
import warnings
from typing import TYPE_CHECKING, Any, Callable, Protocol, runtime_checkable

import torch

from ..group import group
from .callbacks import Callback
from ..errors import ConfigError, usage
from ..strategies.accounting import bytes_sent
from ..wrap import strategy_of

if TYPE_CHECKING:
    from .trainer import Trainer


@runtime_checkable
class Backend(Protocol):
    """Where a :class:`Tracker` writes. Opened on the main worker only, at its first write."""

    def open(self) -> None: ...

    def scalars(self, step: int, values: dict[str, float]) -> None: ...

    def text(self, step: int, tag: str, text: str) -> None: ...

    def params(self, params: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


def _require(module: str, extra: str, backend: str) -> None:
    """Refuse, on every worker alike, a back end whose package is missing (one line)."""
    if importlib.util.find_spec(module) is None:
        raise ConfigError(usage(f"the {backend} logger without the {module!r} package", f"{module} installed",
                                f"pip install 'phalanx[{extra}]'"))


class TensorBoard:
    """``torch.utils.tensorboard.SummaryWriter`` event files under ``log_dir`` (extra ``phalanx[tensorboard]``)."""

    name = "tensorboard"

    def __init__(self, log_dir: str | os.PathLike = "runs") -> None:
        _require("tensorboard", "tensorboard", "TensorBoard")
        self.log_dir = os.fspath(log_dir)
        self.writer: Any = None

    def open(self) -> None:
        from torch.utils.tensorboard import SummaryWriter
        os.makedirs(self.log_dir, exist_ok=True)  # OSError here: the tracker warns once and stops logging
        self.writer = SummaryWriter(self.log_dir)

    def scalars(self, step: int, values: dict[str, float]) -> None:
        for k, v in values.items():
            self.writer.add_scalar(k, v, step)

    def text(self, step: int, tag: str, text: str) -> None:
        self.writer.add_text(tag, text, step)

    def params(self, params: dict[str, Any]) -> None:
        self.writer.add_text("params", "\n".join(f"{k}: {v}" for k, v in params.items()), 0)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()

    def __repr__(self) -> str:
        return f"TensorBoard({self.log_dir!r})"


class MLflow:
    """An MLflow run in a local file store (``tracking_uri`` default ``file:<dir>``; extra ``phalanx[mlflow]``).

    Uses ``MlflowClient`` (no global active run), so it does not touch a run of your own.
    """

    name = "mlflow"

    def __init__(self, tracking_uri: str | os.PathLike = "mlruns", *, experiment: str = "phalanx",
                 run_name: str | None = None) -> None:
        _require("mlflow", "mlflow", "MLflow")
        uri = os.fspath(tracking_uri)
        self.tracking_uri = uri if "://" in uri or uri.startswith("file:") else "file:" + os.path.abspath(uri)
        if self.tracking_uri.startswith("file:") and _file_store_refused():
            raise ConfigError(usage(f"an MLflow file store ({self.tracking_uri}) with an MLflow that refuses file "
                                    "stores unless told", "MLFLOW_ALLOW_FILE_STORE=true, or a database or server URI",
                                    "export MLFLOW_ALLOW_FILE_STORE=true, or pass e.g. 'sqlite:///mlflow.db' or "
                                    "'http://host:5000'."))
        self.experiment, self.run_name = experiment, run_name
        self.client: Any = None
        self.run_id: str | None = None

    def open(self) -> None:
        from mlflow.tracking import MlflowClient
        self.client = MlflowClient(tracking_uri=self.tracking_uri)
        found = self.client.get_experiment_by_name(self.experiment)
        exp_id = found.experiment_id if found is not None else self.client.create_experiment(self.experiment)
        self.run_id = self.client.create_run(exp_id, run_name=self.run_name).info.run_id

    def scalars(self, step: int, values: dict[str, float]) -> None:
        from mlflow.entities import Metric as _Metric
        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[_Metric(k, float(v), now, step) for k, v in values.items()])

    def text(self, step: int, tag: str, text: str) -> None:
        self.client.set_tag(self.run_id, f"{tag}.{step}", text)

    def params(self, params: dict[str, Any]) -> None:
        for k, v in params.items():
            self.client.log_param(self.run_id, k, v)

    def close(self) -> None:
        if self.client is not None and self.run_id is not None:
            self.client.set_terminated(self.run_id)

    def __repr__(self) -> str:
        return f"MLflow({self.tracking_uri!r}, experiment={self.experiment!r})"


class WandB:
    """A Weights & Biases run, offline by default: files under ``<dir>/wandb/offline-run-*`` (``phalanx[wandb]``).

    Nothing leaves the machine until you run ``wandb sync <dir>/wandb/offline-run-*``; pass ``mode=None`` to let
    wandb decide (``WANDB_MODE``, your ``wandb login``) or ``mode="online"`` to stream. Every row carries ``step``,
    the x-axis of every chart (``define_metric``), so a rollback's repeated steps are kept rather than dropped as
    wandb drops a ``log(step=)`` that goes back. The run is made with ``reinit="create_new"``: it neither ends nor
    replaces a ``wandb.run`` of your own. ``init`` is passed to ``wandb.init`` (``entity``, ``tags``, ``settings``...).
    """

    name = "wandb"

    def __init__(self, dir: str | os.PathLike = ".", *, project: str = "phalanx", run_name: str | None = None,
                 mode: str | None = "offline", **init: Any) -> None:
        _require("wandb", "wandb", "Weights & Biases")
        self.dir, self.project, self.run_name, self.mode, self.init = os.fspath(dir), project, run_name, mode, init
        self.run: Any = None

    def open(self) -> None:
        import wandb
        os.makedirs(self.dir, exist_ok=True)  # OSError here: the tracker warns once and stops logging
        self.run = wandb.init(project=self.project, name=self.run_name, dir=self.dir, mode=self.mode,
                              reinit="create_new", **self.init)
        self.run.define_metric("step")
        self.run.define_metric("*", step_metric="step")

    def scalars(self, step: int, values: dict[str, float]) -> None:
        self.run.log({**values, "step": step})

    def text(self, step: int, tag: str, text: str) -> None:
        self.run.log({tag: text, "step": step})

    def params(self, params: dict[str, Any]) -> None:
        self.run.config.update(params, allow_val_change=True)

    def close(self) -> None:
        if self.run is not None:
            self.run.finish()

    def __repr__(self) -> str:
        return f"WandB({self.dir!r}, project={self.project!r}, mode={self.mode!r})"


def _file_store_refused() -> bool:
    """MLflow 3 refuses a file store unless ``MLFLOW_ALLOW_FILE_STORE`` is true (it reads it at the first write)."""
    try:
        from mlflow.environment_variables import MLFLOW_ALLOW_FILE_STORE
    except ImportError:  # an MLflow without the switch writes file stores freely
        return False
    return not MLFLOW_ALLOW_FILE_STORE.get()


BACKENDS: dict[str, Callable[..., Backend]] = {"tensorboard": TensorBoard, "mlflow": MLflow, "wandb": WandB}


def _backend(backend: str | Backend, where: str | os.PathLike | None) -> Backend:
    if isinstance(backend, str):
        make = BACKENDS.get(backend.lower())
        if make is None:
            raise ConfigError(usage(f"logger back end {backend!r}", "one of " + ", ".join(sorted(BACKENDS)),
                                    "Pass e.g. px.Tracker('tensorboard', 'runs/exp1'), or a back-end object."))
        return make() if where is None else make(where)
    if not isinstance(backend, Backend):
        raise ConfigError(usage(f"logger back end of type {type(backend).__name__}",
                                "a name or an object with open/scalars/text/params/close",
                                "Pass 'tensorboard', 'mlflow', 'wandb', TensorBoard(dir) or your own."))
    if where is not None:
        raise ConfigError(usage("a back-end object and a location", "the location inside the object",
                                f"Pass {type(backend).__name__}(...) alone."))
    return backend


class Tracker(Callback):
    """Log from the main worker only; a Trainer callback as well. Build it on every worker (see the module doc).

    Args:
        backend: ``"tensorboard"``, ``"mlflow"``, ``"wandb"`` or a back-end object.
        where: the back end's location (TensorBoard's log dir, MLflow's tracking URI or directory, the directory
            that holds W&B's ``wandb/`` folder).
        optimizer: the optimizer ``px.wrap`` returned: adds ``lr`` and ``bytes_sent`` to every log.
        elastic: a ``px.elastic.State``: membership changes then name who left and joined.
        every: write one ``log`` call in ``every`` (``batch_size`` still counts every call).
    """

    def __init__(self, backend: str | Backend = "tensorboard", where: str | os.PathLike | None = None, *,
                 optimizer: torch.optim.Optimizer | None = None, elastic: Any = None, every: int = 1) -> None:
        if not isinstance(every, int) or isinstance(every, bool) or every < 1:
            raise ConfigError(usage(f"every={every!r}", "an integer >= 1", "Pass e.g. every=10 (log calls)."))
        self.backend = _backend(backend, where)
        self.optimizer, self.elastic_state, self.every = optimizer, elastic, every
        self.failed = False        # a write failed: warned once, logging stopped, training unaffected
        self._opened_by: int | None = None  # the group generation in which this worker opened the back end
        self._unsubscribe: Callable[[], None] | None = None
        self._changes: list[dict[str, Any]] = []  # membership changes not yet written
        self._history_seen = 0
        self._calls = 0
        self._samples = 0
        self._last_step: int | None = None
        self._last_time: float | None = None
        self._world = None

    # -- the user's loop ------------------------------------------------------------------------------------
    def log(self, step: int, *, batch_size: int | None = None, **metrics: float) -> None:
        """Record ``metrics`` (plain numbers or 0-d tensors) at ``step``; writes from the main worker only.

        ``batch_size``: this worker's samples in the step, for ``samples_per_s`` (global rate between writes).
        Not collective: call it on every worker or only on the main one. Numbers from 0-d tensors
        cost a device sync; log every few steps on a GPU.
        """
        g = self._subscribe()
        self._calls += 1
        self._samples += int(batch_size or 0)
        if self._calls % self.every and not self._changes:
            return
        now = time.perf_counter()
        values = {k: float(v.detach()) if isinstance(v, torch.Tensor) else float(v) for k, v in metrics.items()}
        values["world_size"] = g.world_size
        if self.optimizer is not None:
            values["lr"] = float(self.optimizer.param_groups[0]["lr"])
            strategy = strategy_of(self.optimizer)
            if strategy is not None:
                values["bytes_sent"] = bytes_sent(strategy)
        if batch_size is not None and self._last_time is not None and now > self._last_time:
            values["samples_per_s"] = self._samples * g.world_size / (now - self._last_time)
        if batch_size is not None or self._last_time is None:
            self._samples, self._last_time = 0, now
        events = self._membership(step, now)
        self._last_step = step
        if self._write(lambda b: (b.scalars(step, values), [b.text(step, "membership", e) for e in events])):
            self._last_time = time.perf_counter()  # opening a back end (wandb: seconds) is no training time

    def log_params(self, params: dict[str, Any]) -> None:
        """Record hyperparameters once (main worker only)."""
        self._subscribe()
        self._write(lambda b: b.params(dict(params)))

    def close(self) -> None:
        """Flush and close the back end; stop following membership changes."""
        if self._unsubscribe is not None:
            self._unsubscribe()
            self._unsubscribe = None
        if self._opened_by is not None and not self.failed:
            try:
                self.backend.close()
            except Exception as err:  # noqa: BLE001 - logging must not end training, whatever the back end raises
                self._fail(err)
        self._opened_by = None

    def __enter__(self) -> "Tracker":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- the Trainer ----------------------------------------------------------------------------------------
    def on_train_begin(self, trainer: "Trainer") -> None:
        if self.optimizer is None:
            self.optimizer = trainer.optimizer

    def on_step_end(self, trainer: "Trainer", step: int, logs: dict[str, float]) -> None:
        self.log(step + 1, batch_size=int(logs.get("batch_size", 0)), loss=logs["loss"], step_s=logs["step_s"])

    def on_epoch_end(self, trainer: "Trainer", epoch: int, logs: dict[str, Any]) -> None:
        row = {f"epoch/{k}": float(v) for k, v in logs.items()
               if isinstance(v, (int, float)) and not isinstance(v, bool) and k not in ("step", "epoch")}
        step = int(logs.get("step", trainer.step))
        self._subscribe()
        self._write(lambda b: b.scalars(step, row))

    def on_train_end(self, trainer: "Trainer") -> None:
        self.close()

    # -- inside ---------------------------------------------------------------------------------------------
    def _subscribe(self) -> group.Group:
        g = group.current()
        if self._unsubscribe is None and group.is_initialized():  # before px.init() nothing can regroup
            self._world = g.world_size
            self._unsubscribe = g.on_regroup(self._regrouped)
        return g

    def _regrouped(self, g: group.Group) -> None:
        """Group.on_regroup: runs on every worker inside the rebuild; written at the next log (main only)."""
        self._changes.append({"generation": g.generation, "was": self._world, "world_size": g.world_size,
                              "last_step": self._last_step, "last_time": self._last_time})
        self._world = g.world_size

    def _membership(self, step: int, now: float) -> list[str]:
        """One line per membership change since the last write: what changed, where, and what it cost."""
        history = list(getattr(self.elastic_state, "history", []) or [])
        named = {h.get("generation"): h for h in history[self._history_seen:]}
        self._history_seen = len(history)
        lines = []
        for c in self._changes:
            h = named.get(c["generation"], {})
            who = (f"; left: {', '.join(h.get('left', [])) or '-'}; joined: {', '.join(h.get('joined', [])) or '-'}"
                   if h else "")
            last = c["last_step"]
            redo = f" ({last - step + 1} step(s) redone)" if last is not None and step <= last else ""
            cost = f"; {now - c['last_time']:.2f}s between the logs around it" if c["last_time"] is not None else ""
            lines.append(f"generation {c['generation']}: {c['was']} -> {c['world_size']} workers{who}; "
                         f"last step logged before: {last}; first after: {step}{redo}{cost}")
        self._changes = []
        return lines

    def _write(self, action: Callable[[Backend], Any]) -> bool:
        """Run ``action`` on the main worker, opening the back end first if needed; True when it opened it."""
        if self.failed or not group.is_main():
            return False
        g = group.current()
        opened = self._opened_by is None
        try:
            if opened:
                self.backend.open()
                self._opened_by = g.generation
            action(self.backend)
        except Exception as err:  # noqa: BLE001 - a logging failure (unwritable dir, full disk) must not end training
            self._fail(err)
        return opened

    def _fail(self, err: BaseException) -> None:
        self.failed = True
        warnings.warn(f"phalanx: logging to {self.backend!r} stopped ({type(err).__name__}: {err}); "
                      "training goes on without it", RuntimeWarning, stacklevel=3)

    def __repr__(self) -> str:
        return f"Tracker({self.backend!r}, every={self.every})"


__all__ = ["BACKENDS", "Backend", "MLflow", "TensorBoard", "Tracker", "WandB"]
