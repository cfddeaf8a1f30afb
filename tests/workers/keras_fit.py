"""Keras 3 (torch backend) scenarios for 2 real workers; every scenario runs in one group (Keras imports slowly).

Oracles are plain Keras on one process (``fit(x, y, batch_size=2b, shuffle=False)``),
computed on rank 0 beside the wrapped model. Results are tensors and plain values.
"""
from __future__ import annotations

import os

os.environ.setdefault("KERAS_BACKEND", "torch")

import numpy as np  # noqa: E402
import torch  # noqa: E402

import phalanx as px  # noqa: E402

B = 4            # per-worker batch
STEPS = 12       # per epoch (96 samples / (2 x 4)); 2 epochs = 24 steps
N_VAL = 101      # uneven: the last global batch of 16 splits 3 / 2


def _data(seed: int = 0) -> tuple[np.ndarray, ...]:
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(96 + N_VAL, 6)).astype("float32")
    y = (x[:, 0] + 0.5 * x[:, 1] > 0).astype("int64") + (x[:, 2] > 1).astype("int64")
    return x[:96], y[:96], x[96:], y[96:]


def _model(keras, optimizer, seed: int):  # noqa: ANN001, ANN202
    keras.utils.set_random_seed(seed)
    m = keras.Sequential([keras.Input((6,)), keras.layers.Dense(16, activation="tanh"), keras.layers.Dense(3)])
    m.compile(optimizer=optimizer, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
              metrics=["accuracy"])
    return m


def _weights(m) -> list[torch.Tensor]:  # noqa: ANN001
    return [v.value.detach().cpu().clone() for v in m.trainable_variables]


def _oracle_vs_wrapped(keras, make_opt, x, y, xv, yv) -> dict:  # noqa: ANN001
    """2 workers x b against plain Keras on one process x 2b (rank 0 computes the oracle)."""
    model = _model(keras, make_opt(), seed=100 + px.rank())  # seeded differently on purpose
    before = _weights(model)
    model = px.keras.wrap(model, strategy=px.AllReduce())
    after_wrap = _weights(model)
    oracle = _model(keras, make_opt(), seed=7)
    oracle.set_weights(model.get_weights())
    hist = model.fit(px.keras.shard(x, y, batch_size=B, shuffle=False), epochs=2, verbose=0,
                     validation_data=px.keras.shard(xv, yv, batch_size=2 * B, shuffle=False))
    out = {"overlapped": px.keras.strategy_of(model)._overlap is not None,  # AllReduce's hooks, not DDP
           "before": before, "after_wrap": after_wrap, "final": _weights(model), "history": hist.history,
           "optimizer": [v.value.detach().cpu().clone() for v in model.optimizer.variables]}
    ev = model.evaluate(px.keras.shard(xv, yv, batch_size=5, shuffle=False), verbose=0, return_dict=True)
    out["evaluate"] = ev
    if px.rank() == 0:
        ohist = oracle.fit(x, y, batch_size=2 * B, epochs=2, shuffle=False, verbose=0, validation_data=(xv, yv),
                           validation_batch_size=4 * B)
        out["oracle_final"], out["oracle_history"] = _weights(oracle), ohist.history
        oracle.set_weights(model.get_weights())
        out["oracle_evaluate"] = oracle.evaluate(xv, yv, batch_size=10, verbose=0, return_dict=True)
    return out


def _local_sgd(keras, x, y) -> dict:  # noqa: ANN001
    model = _model(keras, keras.optimizers.SGD(0.05, momentum=0.9), seed=200 + px.rank())
    model.optimizer.build(model.trainable_variables)
    for v in model.optimizer.variables:  # as if each worker had resumed a different optimizer state
        if "learning_rate" not in v.path:
            v.assign(keras.ops.ones_like(v) * (px.rank() + 1) * (1 if "int" in str(v.dtype) else 0.01))
    model = px.keras.wrap(model, strategy=px.LocalSGD(every=4))  # no DDP involved: phalanx's broadcast only
    at_wrap = {"weights": _weights(model), "optimizer": [v.value.detach().clone() for v in model.optimizer.variables]}
    snaps: dict[int, list[torch.Tensor]] = {}

    class Record(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):  # noqa: ANN001, ANN201
            snaps[batch + 1] = _weights(self.model)

    model.fit(px.keras.shard(x, y, batch_size=B, shuffle=True, seed=3), epochs=1, verbose=0, callbacks=[Record()])
    return {"steps": {str(k): v for k, v in snaps.items()}, "final": _weights(model), "at_wrap": at_wrap}


def _files_and_stopping(keras, x, y, xv, yv, tmp: str) -> dict:  # noqa: ANN001
    # Each worker in its own directory, as on separate machines: a file written by a non-main worker shows up.
    here = os.path.join(tmp, f"rank{px.rank()}")
    os.makedirs(here, exist_ok=True)
    os.chdir(here)
    model = px.keras.wrap(_model(keras, keras.optimizers.Adam(1e-2), seed=300 + px.rank()))
    epochs_run: list[int] = []

    class StopOnRank0(keras.callbacks.Callback):  # a callback that decides on one worker only
        def on_epoch_end(self, epoch, logs=None):  # noqa: ANN001, ANN201
            epochs_run.append(epoch)
            if px.rank() == 0 and epoch == 2:
                self.model.stop_training = True

    hist = model.fit(px.keras.shard(x, y, batch_size=B), epochs=6, verbose=0,
                     validation_data=px.keras.shard(xv, yv, batch_size=8, shuffle=False),
                     callbacks=[keras.callbacks.ModelCheckpoint("best.keras"), keras.callbacks.CSVLogger("log.csv"),
                                StopOnRank0()])
    early = px.keras.wrap(_model(keras, keras.optimizers.SGD(1e-3), seed=400))
    stopper = keras.callbacks.EarlyStopping(monitor="val_loss", min_delta=10.0, patience=1)
    ehist = early.fit(px.keras.shard(x, y, batch_size=B), epochs=6, verbose=0, callbacks=[stopper],
                      validation_data=px.keras.shard(xv, yv, batch_size=8, shuffle=False))
    probe = xv[:7]
    if px.is_main():
        model.save("final.keras")
    return {"epochs_run": epochs_run, "history_epochs": len(hist.history["loss"]),
            "early_epochs": len(ehist.history["loss"]), "probe": torch.from_numpy(probe),
            "predictions": torch.from_numpy(np.asarray(model.predict(probe, verbose=0))),
            "files": sorted(os.listdir(here)), "dir": here}


def _resume(keras, x, y, tmp: str) -> dict:  # noqa: ANN001
    def fresh(seed: int):  # noqa: ANN202
        return px.keras.wrap(_model(keras, keras.optimizers.Adam(1e-2), seed=seed))

    data = px.keras.shard(x, y, batch_size=B, shuffle=True, seed=5)
    straight = fresh(500 + px.rank())
    start = straight.get_weights()
    straight.fit(data, epochs=4, verbose=0)
    first = fresh(600 + px.rank())
    first.set_weights(start)
    first.fit(px.keras.shard(x, y, batch_size=B, shuffle=True, seed=5), epochs=2, verbose=0)
    path = os.path.join(tmp, "resume.ckpt")
    px.keras.save_checkpoint(path, first, epoch=2)
    px.barrier()
    resumed = fresh(700 + px.rank())  # different weights and a fresh optimizer until the load
    epoch = px.keras.load_checkpoint(path, resumed)
    resumed.fit(px.keras.shard(x, y, batch_size=B, shuffle=True, seed=5), epochs=4, initial_epoch=epoch, verbose=0)
    return {"straight": _weights(straight), "resumed": _weights(resumed), "epoch": epoch}


def _other_strategies(keras, x, y) -> dict:  # noqa: ANN001
    """The same strategy objects as for plain PyTorch: a compressor (averaging in backward), DiLoCo, EASGD."""
    out = {}
    for name, strategy in (("fp16", px.AllReduce(compression=px.FP16())), ("diloco", px.DiLoCo(every=5)),
                           ("easgd", px.EASGD(every=2))):
        model = px.keras.wrap(_model(keras, keras.optimizers.Adam(1e-2), seed=900 + px.rank()), strategy=strategy)
        model.fit(px.keras.shard(x, y, batch_size=B, shuffle=False), epochs=1, verbose=0)  # 12 steps, then finish
        out[name] = {"final": _weights(model), "steps": strategy.steps}
    plain = px.keras.wrap(_model(keras, keras.optimizers.Adam(1e-2), seed=900 + px.rank()))
    plain.fit(px.keras.shard(x, y, batch_size=B, shuffle=False), epochs=1, verbose=0)
    out["allreduce"] = {"final": _weights(plain), "steps": px.keras.strategy_of(plain).steps}
    return out


def everything(tmp: str) -> dict:
    px.init()
    torch.set_num_threads(1)
    import keras

    x, y, xv, yv = _data()
    return {
        "adam": _oracle_vs_wrapped(keras, lambda: keras.optimizers.Adam(1e-2, clipnorm=0.05), x, y, xv, yv),
        # 93 samples: the last global batch of each epoch is 5, split 3 / 2 (weighted by sample counts)
        "sgd": _oracle_vs_wrapped(keras, lambda: keras.optimizers.SGD(0.1, momentum=0.9, clipnorm=0.05),
                                  x[:93], y[:93], xv, yv),
        "local_sgd": _local_sgd(keras, x, y),
        "files": _files_and_stopping(keras, x, y, xv, yv, tmp),
        "resume": _resume(keras, x, y, tmp),
        "bad": _bad_input_and_warnings(keras, x, y),
        "strategies": _other_strategies(keras, x, y),
        "bench": _bench_setup(),
        "tail": _short_tail(keras, x, y, xv, yv),  # here too: one pair of processes (Keras's import) for both
    }


def _short_tail(keras, x, y, xv, yv) -> dict:  # noqa: ANN001
    out = _oracle_vs_wrapped(keras, lambda: keras.optimizers.SGD(0.1, momentum=0.9), x[:89], y[:89], xv, yv)
    out["history"] = {k: [float(v) for v in vs] for k, vs in out["history"].items()}
    return out


def short_tail() -> dict:
    """89 samples: 11 global batches of 8, then 1 sample, fewer than the 2 workers (one gets an empty part)."""
    px.init()
    torch.set_num_threads(1)
    import keras

    return _short_tail(keras, *_data())


def _bench_setup() -> dict:
    """``phalanx bench --keras``'s own worker, tiny, on both paths (a smoke run: it trains and times)."""
    from phalanx.bench.keras_setup import worker
    tiny = dict(steps=3, warmup=1, batch=8, width=16, depth=1)
    return {"keras": worker("keras", True, **tiny), "torch": worker("torch", True, **tiny)}


def _bad_input_and_warnings(keras, x, y) -> dict:  # noqa: ANN001
    import warnings

    from phalanx.errors import ConfigError

    model = px.keras.wrap(_model(keras, keras.optimizers.SGD(0.1), seed=800))
    try:
        model.fit(x, y, batch_size=B, verbose=0)  # unsharded arrays would train every worker on everything
        raw = ""
    except ConfigError as err:
        raw = str(err)

    class Peak(keras.metrics.Metric):  # state is a maximum, not a sum: cannot be combined exactly
        def __init__(self) -> None:
            super().__init__(name="peak")
            self.top = self.add_variable(shape=(), initializer="zeros", name="top")

        def update_state(self, y_true, y_pred, sample_weight=None):  # noqa: ANN001, ANN201
            self.top.assign(keras.ops.maximum(self.top, keras.ops.max(y_pred)))

        def result(self):  # noqa: ANN201
            return self.top

    peaked = _model(keras, keras.optimizers.SGD(0.1), seed=801)
    peaked.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                   metrics=["accuracy", Peak()])
    peaked = px.keras.wrap(peaked)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        peaked.evaluate(px.keras.shard(x, y, batch_size=8, shuffle=False), verbose=0)
    return {"raw_arrays": raw, "warnings": [str(w.message) for w in caught if "phalanx" in str(w.message)]}
