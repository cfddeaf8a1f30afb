"""The high-level loop: ``px.Trainer(...).fit(...)``.

The Trainer does what the four-line loop does (``px.init``, ``px.wrap``,
``px.shard`` with ``set_epoch``) and adds the things that are easy to get wrong
by hand: validation whose metrics are exact across workers, a throughput meter
that skips warm-up, a progress bar on the main worker only, callbacks, and
resumable checkpoints.

Example:
    >>> import torch, torch.nn.functional as F, phalanx as px
    >>> from phalanx.train.trainer import Trainer
    >>> data = torch.utils.data.TensorDataset(torch.randn(64, 4), torch.randint(0, 2, (64,)))
    >>> net = torch.nn.Linear(4, 2)
    >>> trainer = Trainer(net, torch.optim.SGD(net.parameters(), lr=0.1), F.cross_entropy, metrics=["accuracy"])
    >>> history = trainer.fit(data, epochs=2, batch_size=16, val_data=data, progress=False)
    >>> sorted(history[-1])[:4]
    ['accuracy', 'bytes_sent', 'epoch', 'loss']

Batches are ``(inputs..., target)`` tuples: the model is called as
``model(*inputs)`` and the loss as ``loss_fn(output, target)``.

On a terminal the main worker shows a progress bar per epoch; when stdout is not
a terminal (CI, a log file) it prints a plain line every 30 s and one per epoch.
History rows count epochs from 1, as the progress bar does. In a script run by
``phalanx run`` or torchrun, end with ``px.shutdown()`` (it also runs at exit):
it leaves the group cleanly once every worker is done.
"""
from __future__ import annotations

import math
import os
import time
from typing import Any, Callable, Protocol, Sequence

import torch
from torch import nn
from torch.utils.data import Dataset

from .. import check
from ..group import group
from ..group.records import Record, Slot
from ..step import preempt
from .callbacks import Callback, ModelCheckpoint
from ..checkpoint import load_checkpoint, save_checkpoint
from ..group.collectives import Comm
from ..data.loader import ShardedLoader, shard
from .epoch_report import epoch_row, step_postfix
from ..errors import ConfigError, usage
from .evaluation import check_eval, evaluate_share
from .metrics import MeanLoss, Metric, ThroughputMeter, batch_denominator, check_loss, reduce_all, resolve
from .progress import bar as _bar
from .progress import postfix as _postfix
from ..strategies import Strategy
from ..strategies.accounting import bytes_sent as bytes_sent_by
from ..strategies.auto import PlansLength
from ..wrap import strategy_of, unwrap, wrap



class Supervised(Protocol):
    """A training loop under supervision: re-entered at a shared commit after a membership change."""

    history: list[dict[str, Any]]

    def supervise(self, loop: Callable[[], None]) -> None: ...


class Supervisor(Protocol):
    """What supervises an elastic fit: called with the fit's model, optimizer and loader (``px.elastic.State``)."""

    def __call__(self, model: nn.Module, optimizer: torch.optim.Optimizer, loader: Any, *, commit_every: int | None,
                 resize: Any) -> Supervised: ...


# The group's supervisor of elastic fits: phalanx.elastic sets it when it takes this worker's place in an elastic
# job (px.init()), None elsewhere; the Trainer hands it the epoch loop, so the core never imports the feature.
SUPERVISOR: "Record[Slot[Supervisor]]" = Record("supervisor of elastic fits", Slot)

class History(list):
    """One dict per epoch; ``history["val_accuracy"]`` gives that column as a list.

    ``samples_per_s`` is the global rate over the whole fit, warm-up excluded.
    """

    samples_per_s: float = math.nan

    def __getitem__(self, key: Any) -> Any:
        if isinstance(key, str):
            return [row.get(key) for row in self]
        return super().__getitem__(key)


class Trainer:
    """Train ``model`` data-parallel with ``optimizer`` on ``loss_fn(output, target)``.

    Args:
        model, optimizer: the user's own objects; the Trainer wraps them with
            ``px.wrap`` (or uses them as they are if ``px.wrap`` already did).
        loss_fn: returns the batch's mean loss, e.g. ``F.cross_entropy``.
        strategy: a strategy object or name; default ``px.AllReduce()``.
        metrics: ``Metric`` objects or names ("accuracy"); computed on training
            batches (as they pass) and on the validation set (``val_`` prefix).
        callbacks: :class:`phalanx.train.callbacks.Callback` objects.
        warmup_steps: steps at the start of a fit left out of samples/s.

    Attributes useful to callbacks: ``model`` (what trains, maybe a DDP wrapper),
    ``module`` (the user's module), ``optimizer``, ``strategy``, ``loader``,
    ``epoch``, ``step`` (optimizer steps taken), ``history``, ``meter``, ``stop_training``.
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, loss_fn: Callable[..., torch.Tensor], *,
                 strategy: Strategy | str | None = None, metrics: Sequence[Metric | str] | None = None,
                 callbacks: Sequence[Callback] | None = None, warmup_steps: int = 5) -> None:
        if not callable(loss_fn):
            raise ConfigError(usage(f"loss_fn={loss_fn!r}", "a callable loss_fn(output, target) -> scalar tensor",
                                    "Pass e.g. torch.nn.functional.cross_entropy."))
        check_loss(loss_fn)  # a loss whose validation mean cannot be combined exactly is refused now, not at epoch end
        self.loss_fn = loss_fn
        self.metrics = [resolve(m) for m in (metrics or [])]
        names = [m.name for m in self.metrics]
        if len(set(names)) != len(names) or "loss" in names:
            raise ConfigError(usage(f"metrics named {names}", "distinct names other than 'loss' (always reported)",
                                    "Drop the duplicates."))
        self.callbacks = list(callbacks or [])
        for cb in self.callbacks:
            if not isinstance(cb, Callback):
                raise ConfigError(usage(f"callback of type {type(cb).__name__}", "a phalanx.train.callbacks.Callback",
                                        "Subclass Callback, or use LambdaCallback(on_epoch_end=...)."))
        self.warmup_steps = warmup_steps
        self.meter = ThroughputMeter(warmup_steps)  # checks warmup_steps
        if not group.is_initialized():
            group.init()
        attached = strategy_of(optimizer)
        if attached is None:
            self.model, self.optimizer = wrap(model, optimizer, strategy)
        elif strategy is not None and strategy is not attached:
            raise ConfigError(usage("strategy= for an optimizer that px.wrap already wrapped",
                                    "one strategy per optimizer", "Drop strategy= or pass the unwrapped objects."))
        else:
            self.model, self.optimizer = model, optimizer
        self.strategy = strategy_of(self.optimizer)
        self.module = unwrap(self.model)
        self.comm = Comm()  # the trainer's own reductions, kept apart from the strategy's byte count
        self.device = group.device()
        self.loader: ShardedLoader | None = None
        self.history = History()
        self.epoch = 0
        self.stop_training = False
        self._in_epoch = self._finished = self._elastic = False

    @property
    def step(self) -> int:
        """Optimizer steps taken: the framework's one count (``px.strategy_of(optimizer).steps``), read-only.

        The same on every rank; it continues across ``fit()`` calls, is rolled back with an elastic
        commit and restored by ``resume_from``.
        """
        return self.strategy.steps if self.strategy is not None else 0

    # -- training -----------------------------------------------------------------
    def fit(self, train_data: Dataset | ShardedLoader, *, epochs: int = 1, batch_size: int = 32,
            val_data: Dataset | None = None, seed: int = 0, shuffle: bool = True, drop_last: bool = False,
            val_batch_size: int = 256, resume_from: str | os.PathLike | None = None, progress: bool = True,
            loader_kwargs: dict[str, Any] | None = None, elastic: int | bool = False,
            resize: Any = None) -> History:
        """Train for ``epochs`` epochs; returns the history, one dict per epoch.

        ``batch_size`` is per worker: a step trains on ``world_size * batch_size`` samples, exactly the
        batches one process sees with that batch and ``seed``. A ``px.shard`` loader may be passed
        instead of a dataset; its own batch size and seed then apply. ``resume_from`` continues from a
        checkpoint (``ModelCheckpoint`` or :meth:`save_checkpoint`) as the uninterrupted run would;
        ``epochs`` is then the total, counting the epochs done before the checkpoint.
        ``resume_from="auto"``: the checkpoint ``phalanx run --resume-from`` chose, else the newest in the
        preemption directory (a fresh start when there is none). A SIGTERM or SIGUSR1 (preemption) makes
        every worker stop after the same step, save to ``--checkpoint-dir`` (else the folder of a
        ``ModelCheckpoint``, else ``checkpoints/``) and exit with ``px.PREEMPTED_EXIT``.

        Each history row holds ``epoch`` (counted from 1, as the progress bar), ``loss``, each metric, ``val_loss`` and
        ``val_<metric>`` (with ``val_samples``), ``samples_per_s`` (global, warm-up
        excluded), ``bytes_sent`` (by this worker's strategy), ``steps`` (this epoch),
        ``step`` (total) and ``time_s``; every value is the same on every worker.

        ``elastic`` (True, or the steps between in-memory commits): under ``phalanx run
        --elastic`` a lost worker no longer ends the fit; the survivors roll back to the
        last commit and go on (see ``px.elastic``). Each row then has ``world_size``, the progress bar
        shows the workers, and ``history.membership`` lists every change (who left, who joined, at which
        step, the steps and seconds redone). ``resize`` says what a change keeps:
        ``px.elastic.KeepWorkerBatch()`` (default) or ``px.elastic.KeepGlobalBatch()``. Elsewhere it changes nothing.
        """
        check.integer("epochs", epochs, "Pass e.g. epochs=10.")
        if resize is not None and not elastic:
            raise ConfigError(usage(f"fit(resize={resize!r}) without elastic", "fit(elastic=10, resize=...)",
                                    "Pass elastic=True (or the steps between commits) with resize."))
        commit_every = 10 if elastic is True else check.positive_int(
            "fit(elastic", elastic, "Pass elastic=True or the steps between in-memory commits, e.g. elastic=10.",
            close=")") if elastic else None
        if val_data is not None:
            check_eval(val_data, val_batch_size, "val_data", "val_batch_size")
        if isinstance(train_data, ShardedLoader) or hasattr(train_data, "stats"):  # stream: a px.stream.StreamLoader
            self.loader = train_data
        else:
            # device=: batches are prefetched to the GPU on a side stream (a no-op on CPU)
            self.loader = shard(train_data, batch_size, shuffle=shuffle, seed=seed, drop_last=drop_last,
                                device=self.device, **(loader_kwargs or {}))
        if isinstance(self.strategy, PlansLength) and hasattr(self.loader, "__len__"):
            self.strategy.plan(epochs * len(self.loader))  # px.Auto weighs rules by the run's planned length
        self.history, start = History(), 0
        self._preemption = preempt.of()
        if resume_from == "auto":  # the launcher's --resume-from, else the newest checkpoint of this run's directory
            resume_from = preempt.resume_from() or preempt.latest_checkpoint(self._checkpoint_dir())
        if resume_from is not None:
            start = self._resume(resume_from)
        self.meter = ThroughputMeter(self.warmup_steps)
        self.stop_training, self._finished, self._elastic = False, False, bool(elastic)
        show = progress and group.is_main()
        self._call("on_train_begin")

        def epochs_loop(state: Any = None) -> None:
            first = start
            if state is not None:  # (re-)entered at the commit every worker holds
                first = max(start, state.epoch)  # the step count was rolled back with the commit
                del self.history[sum(1 for r in self.history if r["epoch"] <= state.epoch):]
            for epoch in range(first, epochs):
                self.epoch = epoch
                self._call("on_epoch_begin", epoch)
                row = self._epoch(epoch, epochs, val_data, val_batch_size, show)
                if elastic:
                    row["world_size"] = group.world_size()
                self.history.append(row)
                self._call("on_epoch_end", epoch, row)
                if self.stop_training:
                    break

        # Under `phalanx run --elastic` the feature that survives a lost peer (phalanx.elastic) put its supervisor on
        # the group when it took this worker's place (px.init()): it commits every `commit_every` steps and re-enters
        # the epoch loop at the commit the survivors share. Elsewhere an elastic fit is a plain one.
        # (group.current() refuses an elastic worker that skipped px.init(), so a missing supervisor means a job
        # whose membership cannot change)
        supervisor = SUPERVISOR.of(group.current()).value if elastic else None
        if supervisor is not None:
            state = supervisor(self.model, self.optimizer, self.loader, commit_every=commit_every, resize=resize)
            self.history.membership = state.history
            state.supervise(epochs_loop)
        else:
            if elastic:
                self.history.membership = []
            epochs_loop()
        self._finish()
        self.history.samples_per_s = self.meter.global_rate(self.comm)
        self._call("on_train_end")
        return self.history

    def _epoch(self, epoch: int, epochs: int, val_data: Dataset | None, val_batch_size: int,
               show: bool) -> dict[str, Any]:
        loader, model, opt = self.loader, self.model, self.optimizer
        assert loader is not None
        loader.set_epoch(epoch)
        model.train()
        train_metrics = [m.fresh() for m in self.metrics]
        loss_sum, count, steps = 0.0, 0, 0
        bytes0 = bytes_sent_by(self.strategy)
        samples0, seconds0 = self.meter.samples, self.meter.seconds
        bar = _bar(loader.steps_left(), f"epoch {epoch + 1}/{epochs}") if show else None
        t_epoch = time.perf_counter()
        self._in_epoch = True
        self.meter.start()
        mark = self._now()
        for batch in loader:
            inputs, target = self._to_device(batch)
            t_data = self._now()
            step = self.step
            self._call("on_step_begin", step)
            t0 = self._now()
            opt.zero_grad(set_to_none=True)
            output = model(*inputs)
            loss = self.loss_fn(output, target)
            loss.backward()
            t1 = self._now()
            opt.step()
            t2 = self._now()
            n, value = len(target), loss.item()
            if n:  # an empty part of the short last step (its loss is nan, its gradient zero) adds nothing
                weight = batch_denominator(self.loss_fn, output, target)  # padding and class weights, exactly
                loss_sum += value * weight
                count += weight
            with torch.no_grad():
                for m in train_metrics:
                    m.update(output.detach(), target)
            self.meter.step(n)
            steps += 1
            if bar is not None:
                bar.set_postfix(step_postfix(loss_sum / count if count else math.nan, loader,
                                             group.world_size() if self._elastic else None), refresh=False)
                bar.update(1)
            self._call("on_step_end", step, {
                "loss": value, "batch_size": n, "data_s": t_data - mark, "forward_backward_s": t1 - t0,
                "optimizer_s": t2 - t1, "step_s": (t_data - mark) + (t2 - t0)})
            if self._preemption.due:  # every worker agreed to stop after this step (SIGTERM / SIGUSR1)
                self._preempted()
            if self.stop_training:
                break
            mark = self._now()
        self._in_epoch = False
        if epoch == epochs - 1 or self.stop_training:
            self._finish()  # validate the model training ends with, not replicas mid-drift
        val_metrics = self._evaluate_local(val_data, val_batch_size) if val_data is not None else []
        bytes_sent = bytes_sent_by(self.strategy) - bytes0
        local = torch.tensor([loss_sum, count, self.meter.samples - samples0, self.meter.seconds - seconds0,
                              time.perf_counter() - t_epoch, bytes_sent], dtype=torch.float64)
        # One all-reduce per epoch carries the training sums, every metric and the timings.
        totals = reduce_all(train_metrics + val_metrics, self.comm, extra=local)
        row = epoch_row(epoch, totals.tolist(), train_metrics, val_metrics, steps=steps, step=self.step,
                        world_size=group.world_size(), loader=loader)
        if bar is not None:
            bar.set_postfix({**_postfix(row), **({"workers": str(group.world_size())} if self._elastic else {})},
                            refresh=False)
            bar.close()
        return row

    # -- validation -----------------------------------------------------------------
    def evaluate(self, data: Dataset, *, batch_size: int = 256) -> dict[str, float]:
        """Loss and metrics over ``data``, split across workers, each sample counted once.

        Call it on every worker; they share one broadcast and one all-reduce. It
        evaluates rank 0's model, the one ``px.save`` writes, on every worker's
        share: BatchNorm statistics and the replicas of local strategies (LocalSGD,
        DiLoCo, EASGD between syncs) differ per worker. Returns ``loss`` (combined
        as ``loss_fn`` reduces, see :class:`phalanx.train.metrics.MeanLoss`), each metric
        and ``samples`` (the number of samples evaluated, ``len(data)``).
        """
        check_eval(data, batch_size, "data", "batch_size")
        metrics = self._evaluate_local(data, batch_size)
        reduce_all(metrics, self.comm)
        out = {m.name: m.compute() for m in metrics}
        out["samples"] = metrics[0].samples
        return out

    def _evaluate_local(self, data: Dataset, batch_size: int) -> list[Metric]:
        """This worker's share of ``data`` through rank 0's model, metrics not yet reduced (collective;
        :mod:`phalanx.train.evaluation`)."""
        metrics = [MeanLoss(self.loss_fn)] + [m.fresh() for m in self.metrics]
        return evaluate_share(self.module, metrics, data, batch_size, self.comm, self._to_device)

    # -- checkpoints -----------------------------------------------------------------
    def save_checkpoint(self, path: str | os.PathLike, *, blocking: bool = True) -> Any:
        """A resumable checkpoint of the run so far; call it on every worker (each writes its part).

        ``blocking=False`` returns a handle at once and writes in the background (``px.save_checkpoint``).

        From ``on_epoch_end`` it resumes at the next epoch; from ``on_step_end``
        at the next step (the resumed epoch's training loss then covers only the
        steps after the checkpoint; weights are unaffected).
        """
        next_epoch = self.epoch if self._in_epoch else self.epoch + 1
        return save_checkpoint(path, self.model, self.optimizer, loader=self.loader, step=self.step, blocking=blocking,
                               extra={"trainer": {"epoch": next_epoch, "history": [dict(row) for row in self.history]}})

    def _checkpoint_dir(self) -> str:
        """Where a preempted fit saves: ``phalanx run --checkpoint-dir``, else a ModelCheckpoint's folder."""
        folders = [os.path.dirname(cb.path) or "." for cb in self.callbacks if isinstance(cb, ModelCheckpoint)]
        return preempt.checkpoint_dir(folders[0] if folders else "checkpoints")

    def _preempted(self) -> None:
        """Save where the run stands and end this worker with status ``px.PREEMPTED_EXIT`` (every worker)."""
        path = preempt.checkpoint_name(self._checkpoint_dir(), self.step)
        self.save_checkpoint(path)
        if group.is_main():
            print(f"phalanx: preempted after step {self.step}; saved {path}", flush=True)
        raise preempt.Preempted(path)

    def _resume(self, path: str | os.PathLike) -> int:
        body = load_checkpoint(path, self.model, self.optimizer, loader=self.loader)
        state = (body.get("extra") or {}).get("trainer")
        if state is None:  # written by px.save_checkpoint directly: trust the loader's epoch
            return int(self.loader.sampler.epoch) if self.loader is not None else 0
        self.history = History(state["history"])
        return int(state["epoch"])

    # -- helpers -----------------------------------------------------------------------
    def _finish(self) -> None:
        """The strategy's finish condition, once per fit: replicas that drift reconcile (collective)."""
        if not self._finished and self.strategy is not None:
            self.strategy.finish()
        self._finished = True

    def _call(self, hook: str, *args: Any) -> None:
        for cb in self.callbacks:
            getattr(cb, hook)(self, *args)

    def _now(self) -> float:
        if self.device.type == "cuda":
            # Phase times must include the queued kernels; only this stream's, so the prefetch
            # copy running on its side stream keeps overlapping the step.
            torch.cuda.current_stream(self.device).synchronize()
        return time.perf_counter()

    def _to_device(self, batch: Any) -> tuple[list[Any], torch.Tensor]:
        if not isinstance(batch, (list, tuple)) or len(batch) < 2:
            raise ConfigError(usage(f"a batch of type {type(batch).__name__}", "a tuple (inputs..., target)",
                                    "Make the dataset return (x, y), e.g. TensorDataset(x, y)."))
        moved = [t.to(self.device, non_blocking=True) if isinstance(t, torch.Tensor) else t for t in batch]
        return moved[:-1], moved[-1]


__all__ = ["History", "Trainer"]
