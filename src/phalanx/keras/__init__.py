"""phalanx for Keras 3 on the torch backend: data-parallel ``model.fit``.

::

    import os; os.environ["KERAS_BACKEND"] = "torch"
    import keras, phalanx as px

    px.init()
    model = build_model()
    model.compile(optimizer=keras.optimizers.Adam(1e-3), loss="sparse_categorical_crossentropy",
                  metrics=["accuracy"])
    model = px.keras.wrap(model, strategy=px.AllReduce())          # or px.LocalSGD(every=8), px.DiLoCo(...)
    model.fit(px.keras.shard(x, y, batch_size=64), epochs=5,
              validation_data=px.keras.shard(x_val, y_val, batch_size=256))
    if px.is_main():
        model.save("model.keras")                                   # a plain Keras file

Run it with ``phalanx run -n 2 train.py``, ``torchrun --nproc-per-node 2 train.py``
or plain ``python train.py``. Keras itself is imported on first use of a name below
(``phalanx.keras.detect`` never imports it).
"""
from __future__ import annotations

import importlib
import os
from typing import Any

# Keras reads its backend once, at its first import; set the default before anything imports it.
os.environ.setdefault("KERAS_BACKEND", "torch")

_NAMES = {"wrap": "fit", "strategy_of": "fit", "optimizer_of": "fit",
          "shard": "data", "ShardedDataset": "data", "ShardedBatches": "data",
          "save_checkpoint": "optimizer_state", "load_checkpoint": "optimizer_state",
          "OptimizerState": "optimizer_state",
          "Throughput": "throughput", "is_keras_optimizer": "detect"}

__all__ = sorted(_NAMES)


def __getattr__(name: str) -> Any:
    if name in _NAMES:
        return getattr(importlib.import_module(f".{_NAMES[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
