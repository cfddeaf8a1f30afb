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
or plain ``python train.py``. Importing ``phalanx`` alone never imports Keras.
"""
from __future__ import annotations

from .data import ShardedBatches, ShardedDataset, shard
from .detect import is_keras_optimizer
from .state import OptimizerState, load_checkpoint, save_checkpoint
from .wrap import strategy_of, wrap

__all__ = ["wrap", "shard", "strategy_of", "save_checkpoint", "load_checkpoint", "OptimizerState",
           "ShardedDataset", "ShardedBatches", "is_keras_optimizer"]
