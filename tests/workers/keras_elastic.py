"""A Keras ``model.fit`` for ``phalanx run --elastic -n 3 tests/workers/keras_elastic.py --out DIR``.

Each worker records every callback call it hears (:class:`Recorder`), and at each batch
begin the global batch of that step (its sample ids, world size and framework step), from
the plan every worker shares. ``--kill ID@STEP`` kills the worker ``ID`` with SIGKILL as step
``STEP`` begins. At the end each survivor writes ``worker<ID>.json``: its calls, ``history``,
the membership changes and the final weights. ``--mismatch``: each worker builds its own
arrays (no seed before the shuffle), which ``fit`` must refuse.
"""
from __future__ import annotations

import json
import os
import signal

os.environ.setdefault("KERAS_BACKEND", "torch")

import numpy as np  # noqa: E402

import keras  # noqa: E402
import phalanx as px  # noqa: E402
from support.loop import elastic_id, elastic_parser  # noqa: E402

N, N_VAL, DIM, B, LR = 48, 20, 5, 4, 0.1


def data(seed: int = 1) -> tuple[np.ndarray, ...]:
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(N + N_VAL, DIM)).astype("float32")
    y = (x[:, 0] + 0.5 * x[:, 1] > 0).astype("int64") + (x[:, 2] > 1).astype("int64")
    return x[:N], y[:N], x[N:], y[N:]


def model() -> keras.Model:
    keras.utils.set_random_seed(0)
    m = keras.Sequential([keras.Input((DIM,)), keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(3)])
    m.compile(optimizer=keras.optimizers.SGD(LR, momentum=0.9),
              loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
    return m


def weights(m: keras.Model) -> list:
    return [np.asarray(w).tolist() for w in m.get_weights()]


class Recorder(keras.callbacks.Callback):
    """Every call this worker's callbacks hear, with the epoch logs; per batch begin, the step's global batch."""

    def __init__(self, data: object = None, kill: tuple[str, int] | None = None,
                 wait_at: tuple[int, int] = (-1, -1)) -> None:
        super().__init__()
        self.calls: list[list] = []
        self.steps: list[list] = []  # (framework step, epoch, batch, world size, the global batch's sample ids)
        self.data, self.kill, self.epoch, self.wait_at = data, kill, 0, wait_at

    def on_train_begin(self, logs: dict | None = None) -> None:
        self.calls.append(["train_begin"])

    def on_train_end(self, logs: dict | None = None) -> None:
        self.calls.append(["train_end"])

    def on_epoch_begin(self, epoch: int, logs: dict | None = None) -> None:
        self.epoch = epoch
        self.calls.append(["epoch_begin", epoch])

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        self.calls.append(["epoch_end", epoch, {k: float(v) for k, v in (logs or {}).items()}])

    def on_train_batch_begin(self, batch: int, logs: dict | None = None) -> None:
        if self.data is not None:
            step = px.keras.strategy_of(self.model).steps
            if self.kill is not None and self.kill == (elastic_id(), step):
                os.kill(os.getpid(), signal.SIGKILL)
            if step in self.wait_at and px.world_size() < 3:
                wait_for_replacement("asked" if step == self.wait_at[0] else "ready")
            parts = self.data._plan[self.data.begun]
            self.steps.append([step, self.epoch, batch, px.world_size(), [int(i) for p in parts for i in p]])

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        self.calls.append(["batch_end", self.epoch, batch])


def wait_for_replacement(stage: str, timeout_s: float = 120.0) -> None:
    """Block until a replacement has ``asked`` to join (``elastic/joiners``: the next commit point offers it a place)
    or is ``ready`` to enter (``elastic/ready/<id>``: it reached training; the next commit point admits it), whatever
    its start-up took (an event, not a race against Keras's import)."""
    from phalanx.elastic.membership import key
    from phalanx.elastic.worker import ElasticWorker
    from phalanx.group import group
    from support.wait import until

    store = ElasticWorker.of(group.current()).store

    def there() -> bool:
        asked = json.loads(store.get(key("joiners"))) if store.check([key("joiners")]) else []
        return any(stage == "asked" or store.check([key("ready", j)]) for j in asked)

    until(there, timeout=timeout_s, what=f"a replacement {stage}")


def main() -> None:
    p = elastic_parser(epochs=3, commit_every=2)
    p.add_argument("--mismatch", action="store_true", help="each worker shuffles its own copy (no seed)")
    p.add_argument("--mismatch-first", action="store_true",
                   help="first fit each worker's own shuffle (refused: written to refused<ID>.txt), then the data")
    p.add_argument("--wait-at", default="-1,-1",
                   help="A,B: as step A begins with fewer than 3 workers, wait until a replacement asked to join; "
                        "as step B begins, until it is ready to enter (a commit point lies between them)")
    args = p.parse_args()
    victim, _, at = args.kill.partition("@")
    px.init()
    x, y, xv, yv = data()
    if args.mismatch:  # a port that shuffles without a seed: every worker holds another order
        order = np.random.default_rng(int(elastic_id())).permutation(N)
        x, y = x[order], y[order]
    m = px.keras.wrap(model(), commit_every=args.commit_every)
    if args.mismatch_first and not elastic_id().startswith("r"):
        order = np.random.default_rng(int(elastic_id())).permutation(N)
        try:
            m.fit(px.keras.shard(x[order], y[order], batch_size=B), epochs=1, verbose=0)
        except px.ConfigError as err:
            with open(os.path.join(args.out, f"refused{elastic_id()}.txt"), "w") as f:
                f.write(str(err))
    train = px.keras.shard(x, y, batch_size=B, seed=3)
    recorder = Recorder(train, (victim, int(at)) if victim else None,
                        tuple(int(s) for s in args.wait_at.split(",")))
    checkpoint = keras.callbacks.ModelCheckpoint(os.path.join(args.out, "model-{epoch}.keras"))
    try:
        history = m.fit(train, epochs=args.epochs, verbose=0, callbacks=[recorder, checkpoint],
                        validation_data=px.keras.shard(xv, yv, batch_size=2 * B, shuffle=False))
    except px.ConfigError as err:
        with open(os.path.join(args.out, f"refused{elastic_id()}.txt"), "w") as f:
            f.write(str(err))
        raise
    with open(os.path.join(args.out, f"worker{elastic_id()}.json"), "w") as f:
        json.dump({"id": elastic_id(), "rank": px.rank(), "world_size": px.world_size(), "calls": recorder.calls,
                   "steps": recorder.steps, "history": history.history, "epochs": history.epoch,
                   "membership": [{k: h[k] for k in ("left", "joined", "step", "redone_steps")}
                                  for h in history.membership], "weights": weights(m)}, f)
    px.shutdown()


if __name__ == "__main__":
    main()
