"""px.keras.wrap: data-parallel ``model.fit`` for a compiled Keras 3 model on the torch backend.

With ``KERAS_BACKEND=torch`` a Keras model is a ``torch.nn.Module`` whose weights are
torch Parameters, so phalanx's own strategy objects drive it unchanged: the strategy
is attached to the model (broadcasting rank 0's weights) and told about every step
through phalanx's step clock: its ``after_backward`` runs at the end of
``loss.backward()`` inside Keras's ``train_step`` (gradient averaging; ``px.AllReduce``
sends its buckets while that backward runs), its
``after_step`` after Keras's ``optimizer.apply`` (parameter exchanges). So gradients
are averaged before Keras's optimizer applies them, and Keras's ``clipnorm``, loss
scaling, schedules and weight decay see the average, as one process would.
Parameter strategies (LocalSGD, DiLoCo, EASGD) and compressors are the very same
objects as for plain PyTorch.

The wrapped model is the user's own object: ``fit``, ``evaluate``,
``get_metrics_result``, ``compute_metrics`` and the optimizer's ``apply`` get
instance-level wrappers around Keras's own methods (the way Keras itself sets
``model.build``), so ``model.save`` writes a plain ``.keras`` file.

Example:
    >>> import phalanx as px
    >>> from phalanx.keras.keras_api import keras
    >>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    >>> model.compile(optimizer="adam", loss="mse")
    >>> model = px.keras.wrap(model, strategy=px.AllReduce())
    >>> px.keras.strategy_of(model)
    AllReduce(compression=None)
"""
from __future__ import annotations

import inspect
import weakref
from typing import Any

from torch.nn.parallel import DistributedDataParallel

from .. import check
from ..group import group
from ..group.collectives import Comm
from ..errors import ConfigError, usage
from ..strategies import AllReduce, Strategy, by_name
from .callbacks import EpochSync, StopTogether, main_only, stops_mid_epoch
from .data import check_same_data, is_sharded
from .detect import ddp_inside, is_keras_model, is_tf_dataset
from .keras_api import check_backend, keras
from .metrics import ExactMetrics
from .runs import _runs, run_of  # noqa: F401  (run_of: re-exported)
from .optimizer_state import OptimizerState
from .supervised import fit_supervised
from ..train.trainer import SUPERVISOR



def wrap(model: keras.Model, strategy: Strategy | str | None = None, *, commit_every: int = 10) -> keras.Model:
    """Make a compiled Keras model data-parallel under ``strategy`` (default ``px.AllReduce()``); returns it.

    Call it after ``model.compile(...)`` on a built model (one with an ``Input``, or
    after ``model.build(shape)``). Then ``fit`` / ``evaluate`` take ``px.keras.shard(...)`` data.
    At ``fit`` every worker's arrays are compared by digest: workers given different data are refused.

    Under ``phalanx run --elastic`` a lost worker does not end ``fit``: the survivors roll back
    to an in-memory commit (taken every ``commit_every`` steps and at every epoch end) and go on
    (:mod:`phalanx.keras.supervised`); elsewhere ``commit_every`` changes nothing.

    Example:
        >>> import phalanx as px
        >>> from phalanx.keras.keras_api import keras
        >>> m = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)]); m.compile(optimizer="sgd", loss="mse")
        >>> px.keras.wrap(m, strategy=px.LocalSGD(every=4)) is m
        True
    """
    check_backend()
    group.current()  # refuses a multi-worker run that skipped px.init()
    if not is_keras_model(model):
        raise ConfigError(usage(f"a {type(model).__name__}", "a keras.Model", "For a torch.nn.Module use px.wrap."))
    if model in _runs:
        raise ConfigError(usage("a model that px.keras.wrap already wrapped", "a model wrapped once",
                                "Call px.keras.wrap once per model."))
    if not getattr(model, "compiled", False) or model.optimizer is None:
        raise ConfigError(usage("px.keras.wrap before model.compile", "a compiled model",
                                "Call model.compile(optimizer=..., loss=...) first, then px.keras.wrap(model)."))
    if not model.built or not model.trainable_variables:
        raise ConfigError(usage("a model whose weights do not exist yet", "a built model",
                                "Start it with keras.Input(shape) or call model.build(input_shape) before wrap, "
                                "so that rank 0's weights can be copied to every worker."))
    refuse_double_averaging(model)
    commit_every = check.positive_int("px.keras.wrap(commit_every", commit_every,
                                      "Pass the steps between in-memory commits, e.g. commit_every=10.", close=")")
    run = KerasRun(model, _resolve(strategy), commit_every=commit_every)
    _runs[model] = run
    return model


def optimizer_of(model: Any) -> OptimizerState | None:
    """The wrapped model's Keras optimizer as a torch-style state holder (for :class:`phalanx.TrainingState`).

    Its ``strategy`` attribute is the strategy ``wrap`` attached.
    """
    run = _runs.get(model)
    return run.optimizer_state if run is not None else None


def strategy_of(model: Any) -> Strategy | None:
    """The strategy ``px.keras.wrap`` attached to ``model``, if any."""
    run = _runs.get(model)
    return run.strategy if run is not None else None


def refuse_double_averaging(model: Any) -> None:
    """Refuse a model that a DistributedDataParallel (e.g. Keras's own, in a future release) already wraps."""
    where = ddp_inside(model)
    if where is not None:
        raise ConfigError(usage(f"a Keras model already wrapped in DistributedDataParallel ({where})",
                                "a model that only phalanx makes data-parallel",
                                "Averaging gradients twice would silently change training; turn off Keras's own "
                                "distribution for this model, or train it without px.keras.wrap."))


def _resolve(strategy: Strategy | str | None) -> Strategy:
    if strategy is None:
        return AllReduce()
    if isinstance(strategy, str):
        return by_name(strategy)
    if not isinstance(strategy, Strategy):
        raise ConfigError(usage(f"strategy={strategy!r}", "a px.Strategy object or a strategy name",
                                "Use e.g. px.AllReduce() or px.LocalSGD(every=8)."))
    return strategy


class KerasRun:
    """What ``wrap`` attaches to one model: the strategy, the exact metrics, and the method wrappers."""

    def __init__(self, model: Any, strategy: Strategy, *, commit_every: int = 10) -> None:
        self._model = weakref.ref(model)
        self.commit_every = commit_every  # steps between in-memory commits under `phalanx run --elastic`
        self.strategy = strategy
        optimizer = model.optimizer
        if not optimizer.built:
            optimizer.build(model.trainable_variables)
        self.optimizer_state = OptimizerState(optimizer)
        self.optimizer_state.strategy = strategy  # what a TrainingState given this holder checkpoints with it
        # Keras's train_step calls the model itself, never a wrapper that attach returns: AllReduce then
        # averages from per-parameter hooks, overlapping Keras's loss.backward() as DDP would.
        if isinstance(strategy, AllReduce):
            module = strategy.attach(model, self.optimizer_state, wrapper=False)  # broadcasts rank 0's weights
        else:
            module = strategy.attach(model, self.optimizer_state)
        if isinstance(module, DistributedDataParallel):  # a strategy whose average would never run
            raise ConfigError(usage(f"{strategy!r}, which needs the forward pass to go through a DDP wrapper",
                                    "a strategy that averages in after_backward or after_step",
                                    "Average in the strategy's after_backward (phalanx calls it at the end of "
                                    "Keras's loss.backward()), or use px.AllReduce()."))
        self.comm: Comm = strategy.comm
        self.comm.broadcast_([v.value.data for v in optimizer.variables])  # moments, iteration count: rank 0's
        strategy.clock.bind(strategy, model, model, self.optimizer_state)  # Keras calls the model, not `module`
        self.metrics = ExactMetrics(self.comm)
        self._local_metrics = False
        self._keras_apply = optimizer.apply
        self._keras_get_metrics_result = model.get_metrics_result
        self._keras_compute_metrics = model.compute_metrics
        optimizer.apply = self.apply
        model.get_metrics_result = self.get_metrics_result
        model.compute_metrics = self.compute_metrics
        model.fit = self.fit
        model.evaluate = self.evaluate

    @property
    def model(self) -> Any:
        return self._model()

    # -- the step -------------------------------------------------------------------
    def apply(self, grads: list[Any], trainable_variables: Any = None) -> Any:
        """Keras's ``optimizer.apply``; then the step clock closes the step (the strategy's ``after_step``)."""
        self.optimizer_state.stepping()
        out = self._keras_apply(grads, trainable_variables)
        self.optimizer_state.stepped()
        return out

    # -- metrics --------------------------------------------------------------------
    def compute_metrics(self, *args: Any, **kwargs: Any) -> Any:
        """Per-step logs stay this worker's own (no collective per step); epoch and evaluate results are exact."""
        self._local_metrics = True
        try:
            return self._keras_compute_metrics(*args, **kwargs)
        finally:
            self._local_metrics = False

    def get_metrics_result(self) -> dict[str, Any]:
        if self._local_metrics:
            return self._keras_get_metrics_result()
        return self.metrics.results(self.model, self._keras_get_metrics_result)

    # -- fit / evaluate --------------------------------------------------------------
    def fit(self, *args: Any, **kwargs: Any) -> Any:
        """Keras's ``fit`` on sharded data, with the callbacks that keep workers in step."""
        model = self.model
        kwargs = _named(type(model).fit, model, args, kwargs)
        x, y = kwargs.pop("x", None), kwargs.pop("y", None)
        refuse_double_averaging(model)
        if kwargs.get("validation_split"):
            raise ConfigError(usage(f"validation_split={kwargs['validation_split']!r}",
                                    "validation_data=px.keras.shard(x_val, y_val, batch_size=...)",
                                    "A split of each worker's shard would not be the split one process makes; "
                                    "hold out the validation arrays yourself and pass them as validation_data."))
        validation = kwargs.get("validation_data")
        self._check_data(x, y, "x")
        if validation is not None:
            self._check_data(validation, None, "validation_data")
        check_same_data(self.comm, {"x": x, "validation_data": validation})
        callbacks = list(kwargs.pop("callbacks", None) or [])
        every_batch = stops_mid_epoch(callbacks)
        if not group.is_main():
            kwargs["verbose"] = 0
        if is_sharded(x):  # px.keras.shard already shuffles, the same way on every worker; Keras's own
            kwargs["shuffle"] = False  # shuffle would reorder each worker's batches differently
        # Under `phalanx run --elastic` px.init() put the elastic feature's supervisor on the group: it commits and
        # rolls back (phalanx.keras.supervised), as it does for px.Trainer.fit(elastic=...).
        supervisor = SUPERVISOR.of(group.current()).value
        if supervisor is not None:
            if not is_sharded(x) or not hasattr(x, "reassign"):
                raise ConfigError(usage(f"x of type {type(x).__name__} under `phalanx run --elastic`",
                                        "x=px.keras.shard(x, y, batch_size=...) of arrays or a torch Dataset",
                                        "A lost worker's part is re-split by sample; a PyDataset's batches "
                                        "cannot be. Pass the arrays to px.keras.shard."))
            x.keep_short_tail()

            def make_callbacks(position: Any, relay: Any) -> list[Any]:
                return [EpochSync(x, validation, position=position), relay,
                        StopTogether(self.comm, every_batch=every_batch, at_epoch_end=False)]

            return fit_supervised(supervisor, self, x, y, kwargs, callbacks, make_callbacks, self.commit_every)
        stop = StopTogether(self.comm, every_batch=every_batch)
        callbacks = [EpochSync(x, validation), *main_only(callbacks, is_main=group.is_main()), stop]
        history = type(model).fit(model, x, y, callbacks=callbacks, **kwargs)
        self.strategy.finish()  # drifting replicas (LocalSGD, DiLoCo, EASGD) end holding one model
        return history

    def evaluate(self, *args: Any, **kwargs: Any) -> Any:
        """Keras's ``evaluate`` with exact results: each sample of the sharded data counts once."""
        model = self.model
        kwargs = _named(type(model).evaluate, model, args, kwargs)
        x, y = kwargs.pop("x", None), kwargs.pop("y", None)
        if not kwargs.get("_use_cached_eval_dataset"):  # fit's validation was checked in fit
            self._check_data(x, y, "x")
        if not group.is_main():
            kwargs["verbose"] = 0
        return type(model).evaluate(model, x, y, **kwargs)

    def _check_data(self, x: Any, y: Any, name: str) -> None:
        if is_tf_dataset(x):
            raise ConfigError(usage(f"{name}: a tf.data.Dataset", "px.keras.shard(...) data",
                                    "phalanx cannot split a tf.data pipeline exactly; pass NumPy arrays, a "
                                    "keras.utils.PyDataset or a torch Dataset to px.keras.shard."))
        if self.comm.world_size > 1 and x is not None and not is_sharded(x):
            raise ConfigError(usage(f"{name} of type {type(x).__name__} in a {self.comm.world_size}-worker run",
                                    "data from px.keras.shard, which gives each worker its own part",
                                    f"Pass {name}=px.keras.shard(x, y, batch_size=per_worker_batch)."))


def _named(method: Any, model: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    """Keras's own positional arguments as keywords (``fit(x, y, 32, 5)`` works as it does in Keras)."""
    bound = inspect.signature(method).bind(model, *args, **kwargs).arguments
    bound.pop(next(iter(bound)))  # self
    extra = bound.pop("kwargs", {})  # evaluate's **kwargs (fit passes _use_cached_eval_dataset)
    return {**bound, **extra}
