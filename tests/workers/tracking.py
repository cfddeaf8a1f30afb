"""Worker functions for tests/train/test_tracking.py: real processes on gloo write through px.Tracker and Keras.

``everything`` runs on 2 workers: a Trainer fit with a TensorBoard tracker, a plain loop
with an MLflow tracker that sees a real regroup (``Group.rebuild`` into generation 1,
the step rolled back by two), and a Keras fit with Keras's own ``TensorBoard`` callback
(without TensorFlow, writing through a torch stand-in for ``tf.summary``) beside a tracker.
The test reads back what was written: one set of files, from the main worker only.
"""
from __future__ import annotations

import contextlib
import os
from types import SimpleNamespace
from typing import Any, Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F

import phalanx as px


def _data(n: int = 40) -> torch.utils.data.TensorDataset:
    gen = torch.Generator().manual_seed(0)
    return torch.utils.data.TensorDataset(torch.randn(n, 4, generator=gen), torch.randint(0, 2, (n,), generator=gen))


def _trainer(tmp: str) -> dict[str, Any]:
    torch.manual_seed(0)
    net = torch.nn.Linear(4, 2)
    tracker = px.Tracker("tensorboard", os.path.join(tmp, "tb"))
    trainer = px.Trainer(net, torch.optim.SGD(net.parameters(), lr=0.1), F.cross_entropy, metrics=["accuracy"],
                         callbacks=[tracker])
    history = trainer.fit(_data(), epochs=2, batch_size=5, val_data=_data(12), progress=False)
    return {"steps": trainer.step, "val_accuracy": history[-1]["val_accuracy"]}


def _loop_with_regroup(tmp: str) -> dict[str, Any]:
    torch.manual_seed(0)
    net = torch.nn.Linear(4, 2)
    model, opt = px.wrap(net, torch.optim.SGD(net.parameters(), lr=0.05))
    elastic = SimpleNamespace(history=[])  # what px.elastic.State.history holds after a change
    tracker = px.Tracker("mlflow", os.path.join(tmp, "mlruns"), optimizer=opt, elastic=elastic)
    loader = px.shard(_data(), batch_size=4, seed=0)
    loader.set_epoch(0)
    for step, (x, y) in enumerate(loader, start=1):
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        tracker.log(step, loss=loss.item(), batch_size=len(x))
        if step == 3:
            break
    g = px.current_group()
    # a real regroup: every member leaves the group and forms generation 1 (here the same two)
    g.rebuild(g.rank, g.world_size, dist.PrefixStore("tracking-regroup", g.store))
    elastic.history.append({"generation": 1, "left": ["w1"], "joined": ["w2"]})
    tracker.log(2, loss=0.5, batch_size=4)  # a rollback: the loop resumes at step 2
    tracker.close()
    return {"generation": g.generation, "run_id": getattr(tracker.backend, "run_id", None)}


class _TorchSummary:
    """The few ``tf.summary`` calls Keras's ``TensorBoard`` callback makes (``write_graph=False``, per-epoch
    updates), written through ``torch.utils.tensorboard``: a stand-in where TensorFlow is absent, so Keras's own
    callback code decides when and where to write, and the test counts its event files.
    """

    def __init__(self) -> None:
        self._default: list[Any] = []  # the writers entered by ``with writer.as_default():``, innermost last

    def create_file_writer(self, logdir: str) -> Any:
        from torch.utils.tensorboard import SummaryWriter
        summary, writer = self, SummaryWriter(logdir)

        @contextlib.contextmanager
        def as_default(step: Any = None) -> Iterator[Any]:
            summary._default.append(writer)
            try:
                yield writer
            finally:
                summary._default.pop()

        return SimpleNamespace(as_default=as_default, flush=writer.flush, close=writer.close)

    def scalar(self, name: str, value: Any, step: Any) -> bool:
        """Write to the writer entered last; with none, write nothing and return False, as tf.summary does."""
        from phalanx.keras.keras_api import keras
        if not self._default:
            return False
        self._default[-1].add_scalar(name, float(value), int(keras.ops.convert_to_numpy(step)))
        return True


def _keras(tmp: str) -> dict[str, Any]:
    """Keras's own TensorBoard callback beside px.Tracker from a LambdaCallback, both built on every worker.

    Keras 3's callback writes through TensorFlow's ``tf.summary`` even on the torch backend; without TensorFlow
    it writes through :class:`_TorchSummary` (``_summary_module``, the attribute its ``summary`` property caches).
    """
    import importlib.util

    from phalanx.keras.keras_api import keras  # sets the torch backend before Keras's first import
    torch.set_num_threads(1)
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="sparse_categorical_crossentropy")
    model = px.keras.wrap(model)
    x, y = (t.numpy() for t in _data().tensors)
    has_tf = importlib.util.find_spec("tensorflow") is not None
    tracker = px.Tracker("tensorboard", os.path.join(tmp, "keras_tracker"))
    board = keras.callbacks.TensorBoard(log_dir=os.path.join(tmp, "keras_tb"), write_graph=has_tf)
    if not has_tf:
        board._summary_module = _TorchSummary()
    callbacks = [keras.callbacks.LambdaCallback(on_epoch_end=lambda epoch, logs: tracker.log(epoch, **logs)), board]
    model.fit(px.keras.shard(x, y, batch_size=4), epochs=2, verbose=0,
              validation_data=px.keras.shard(x, y, batch_size=8, shuffle=False), callbacks=callbacks)
    tracker.close()
    return {"tensorflow": has_tf}


def everything(tmp: str) -> dict[str, Any]:
    px.init()
    return {"trainer": _trainer(tmp), "keras": _keras(tmp), "loop": _loop_with_regroup(tmp)}
