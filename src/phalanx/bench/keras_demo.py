"""``phalanx demo --keras``: a Keras CNN on the bundled digits, on 1 worker and then on 2.

The same small CNN as the main demo, written in Keras 3 (torch backend) and trained
with ``model.fit`` after ``px.keras.wrap``. Each worker keeps the batch size, so two
workers take half the steps per epoch on twice the samples per step. The demo ends
with the main demo's table: test accuracy, samples/s, speedup and efficiency.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from typing import Any


def digits_cnn_keras(keras: Any) -> Any:
    """The main demo's CNN (two 3x3 convolutions, max-pool, two dense layers) in Keras, channels last."""
    layers = keras.layers
    return keras.Sequential([keras.Input((8, 8, 1)), layers.Conv2D(32, 3, padding="same", activation="relu"),
                             layers.Conv2D(64, 3, padding="same", activation="relu"), layers.MaxPooling2D(2),
                             layers.Flatten(), layers.Dense(128, activation="relu"), layers.Dense(10)])


def digits_arrays() -> tuple[Any, Any, Any, Any]:
    """The main demo's train/test split as NumPy arrays, channels last."""
    from phalanx.bench.models import load_digits_split
    train, test = load_digits_split()
    x, y = train.tensors
    xt, yt = test.tensors
    return (x.permute(0, 2, 3, 1).numpy(), y.numpy(), xt.permute(0, 2, 3, 1).numpy(), yt.numpy())


def train(*, epochs: int = 10, batch_size: int = 128, lr: float = 3e-3, seed: int = 0,
          verbose: int = 2) -> dict[str, Any]:
    """One worker's part of a demo run (call it on every worker); returns the run's summary."""
    import phalanx as px

    px.init()
    from phalanx.keras.keras_api import keras
    from phalanx.keras.throughput import Throughput

    keras.utils.set_random_seed(seed)
    x, y, xt, yt = digits_arrays()
    model = digits_cnn_keras(keras)
    model.compile(optimizer=keras.optimizers.Adam(lr), metrics=["accuracy"],
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model = px.keras.wrap(model)
    meter = Throughput(samples_per_epoch=len(x))
    history = model.fit(px.keras.shard(x, y, batch_size=batch_size, seed=seed), epochs=epochs, verbose=verbose,
                        validation_data=px.keras.shard(xt, yt, batch_size=256, shuffle=False), callbacks=[meter])
    return {"workers": px.world_size(), "test_accuracy": history.history["val_accuracy"][-1],
            "test_samples": len(xt), "train_samples": len(x), "samples_per_s": meter.global_rate(), "epochs": epochs}


def _launch(workers: int, worker_args: list[str]) -> int:
    """``workers`` local processes of this module with the variables ``phalanx run`` sets; worst exit code."""
    from phalanx.bench.procs import free_port
    port = str(free_port())
    procs = []
    for rank in range(workers):
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PHALANX_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
        if workers > 1:
            env.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(workers), LOCAL_WORLD_SIZE=str(workers),
                       MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
        procs.append(subprocess.Popen([sys.executable, "-m", "phalanx.bench.keras_demo", "--worker", *worker_args],
                                      env=env))
    return max(p.wait() for p in procs)


def main(argv: list[str] | None = None) -> int:
    """``phalanx demo --keras``; returns the exit status."""
    from phalanx.bench.demo_table import MIN_ACCURACY, table

    p = argparse.ArgumentParser(prog="phalanx demo --keras", description="A Keras CNN on scikit-learn's digits "
                                "with px.keras.wrap, on 1 worker then on 2.")
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--batch-size", type=int, default=128, help="samples per worker per step")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if min(args.epochs, args.batch_size, *args.workers) < 1:
        p.error("--epochs, --batch-size and --workers take integers >= 1")
    if args.worker:
        import phalanx as px
        summary = train(epochs=args.epochs, batch_size=args.batch_size, lr=args.lr, seed=args.seed)
        if px.is_main() and args.out:
            with open(args.out, "w") as f:
                json.dump(summary, f)
        px.shutdown()
        return 0
    print(f"phalanx demo --keras: a Keras 3 CNN (torch backend) learns the bundled digits with model.fit, on "
          f"{' then '.join(map(str, args.workers))} worker(s); batch {args.batch_size} per worker.", flush=True)
    rows = []
    with tempfile.TemporaryDirectory(prefix="phalanx-keras-demo-") as tmp:
        for n in args.workers:
            print(f"\n== {n} worker{'s' if n > 1 else ''} ==", flush=True)
            out = os.path.join(tmp, f"{n}.json")
            code = _launch(n, ["--epochs", str(args.epochs), "--batch-size", str(args.batch_size), "--lr",
                               str(args.lr), "--seed", str(args.seed), "--out", out])
            if code:
                print(f"phalanx demo --keras: the {n}-worker run failed (exit status {code}).", file=sys.stderr)
                return code
            with open(out) as f:
                rows.append(json.load(f))
    print(f"\n{rows[0]['train_samples']} training / {rows[0]['test_samples']} test images. samples/s: all workers "
          "together, first epoch excluded. efficiency: speedup / workers.\n")
    print(table(rows), flush=True)
    return 1 if any(r["test_accuracy"] < MIN_ACCURACY for r in rows) and args.epochs >= 10 else 0


if __name__ == "__main__":
    sys.exit(main())
