"""Keras 3 with phalanx: wrapper overhead on 1 worker and efficiency on 2, beside plain PyTorch.

Six setups train the same MLP (784 -> depth x width -> 10, SGD, synthetic data) for
``--steps`` timed steps after ``--warmup`` steps, each in fresh processes with one
intra-op thread per worker:

* plain Keras ``model.fit`` on 1 process; phalanx-Keras (``px.keras.wrap``) on 1 and 2 workers;
* the same model in plain PyTorch on 1 process; phalanx (``px.wrap``) on 1 and 2 workers.

It prints each setup's samples/s (median of ``--repeats``), the wrapper overhead on
1 worker (target <= 3%) and the 2-worker efficiency of both paths (rate / (2 x the
plain 1-process rate); target: Keras within 5 points of PyTorch).

    python benchmarks/keras.py --steps 60 --repeats 3
"""
from __future__ import annotations

import os
import sys

# Run as a script, this file's directory comes first on sys.path, and this file is named keras.py:
# drop that entry so `import keras` finds Keras, not this benchmark.
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.getcwd()) != HERE]
os.environ.setdefault("KERAS_BACKEND", "torch")

import argparse  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

SETUPS = [("keras", False, 1), ("keras", True, 1), ("keras", True, 2),
          ("torch", False, 1), ("torch", True, 1), ("torch", True, 2)]


def worker(framework: str, wrapped: bool, steps: int, warmup: int, batch: int, width: int, depth: int) -> float:
    """One worker's timed run; returns all workers' samples/s (rank 0's clock)."""
    import numpy as np
    import torch

    import phalanx as px

    if wrapped:
        px.init()
    torch.set_num_threads(1)
    world = px.world_size()
    n = (steps + warmup) * batch * world
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(n, 784)).astype("float32"), rng.integers(0, 10, n)
    marks: list[float] = []
    if framework == "keras":
        import keras
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((784,)), *[keras.layers.Dense(width, activation="relu")
                                                        for _ in range(depth)], keras.layers.Dense(10)])
        model.compile(optimizer=keras.optimizers.SGD(0.01),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        stamp = keras.callbacks.LambdaCallback(on_train_batch_end=lambda *_, **__: marks.append(time.perf_counter()))
        if wrapped:
            model = px.keras.wrap(model)
            model.fit(px.keras.shard(x, y, batch_size=batch, shuffle=False), epochs=1, verbose=0, callbacks=[stamp])
        else:
            model.fit(x, y, batch_size=batch, shuffle=False, epochs=1, verbose=0, callbacks=[stamp])
    else:
        from torch import nn
        torch.manual_seed(0)
        layers: list[nn.Module] = []
        for i in range(depth):
            layers += [nn.Linear(784 if i == 0 else width, width), nn.ReLU()]
        net = nn.Sequential(*layers, nn.Linear(width, 10))
        opt = torch.optim.SGD(net.parameters(), lr=0.01)
        model = net
        if wrapped:
            model, opt = px.wrap(net, opt)
        data = torch.utils.data.TensorDataset(torch.from_numpy(x), torch.from_numpy(y))
        loader = px.shard(data, batch_size=batch, shuffle=False) if wrapped else \
            torch.utils.data.DataLoader(data, batch_size=batch)
        for xb, yb in loader:
            opt.zero_grad()
            nn.functional.cross_entropy(model(xb), yb).backward()
            opt.step()
            marks.append(time.perf_counter())
    timed = marks[warmup - 1:]
    return (len(timed) - 1) * batch * world / (timed[-1] - timed[0])


def measure(framework: str, wrapped: bool, workers: int, args: argparse.Namespace) -> float:
    from phalanx.testing import run_workers
    kwargs = dict(framework=framework, wrapped=wrapped, steps=args.steps, warmup=args.warmup, batch=args.batch,
                  width=args.width, depth=args.depth)
    env = {"PYTHONPATH": os.pathsep.join([os.path.dirname(HERE), os.environ.get("PYTHONPATH", "")])}
    if not wrapped:  # a plain process: no group variables at all
        env.update(WORLD_SIZE="1", RANK="0", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
    return run_workers("benchmarks.keras:worker", world_size=workers, timeout=600, env=env, **kwargs).results[0]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=60, help="timed steps per run")
    p.add_argument("--warmup", type=int, default=10, help="untimed steps first")
    p.add_argument("--batch", type=int, default=64, help="samples per worker per step")
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--depth", type=int, default=5)
    p.add_argument("--repeats", type=int, default=3, help="runs per setup; the median is reported")
    args = p.parse_args(argv)
    rates: dict[tuple[str, bool, int], float] = {}
    for _ in range(args.repeats):  # interleaved, so slow drifts of the machine hit every setup alike
        for setup in SETUPS:
            rates.setdefault(setup, [])  # type: ignore[arg-type]
            rates[setup].append(measure(*setup, args))  # type: ignore[attr-defined]
    med = {k: statistics.median(v) for k, v in rates.items()}  # type: ignore[arg-type]
    print(f"MLP 784-{args.depth}x{args.width}-10, batch {args.batch} per worker, {args.steps} timed steps, "
          f"median of {args.repeats}; samples/s of all workers together\n")
    print("| setup | workers | samples/s |\n|---|--:|--:|")
    for (fw, wrapped, n), rate in med.items():
        name = ("phalanx-Keras" if wrapped else "plain Keras") if fw == "keras" else \
            ("phalanx (PyTorch)" if wrapped else "plain PyTorch")
        print(f"| {name} | {n} | {rate:,.0f} |")
    overhead = 1 - med[("keras", True, 1)] / med[("keras", False, 1)]
    eff_k = med[("keras", True, 2)] / (2 * med[("keras", False, 1)])
    eff_t = med[("torch", True, 2)] / (2 * med[("torch", False, 1)])
    print(f"\nwrapper overhead, 1 worker: {overhead:+.1%} (target <= 3%)")
    print(f"efficiency on 2 workers: Keras {eff_k:.0%}, PyTorch {eff_t:.0%}: {100 * (eff_k - eff_t):+.0f} points "
          "(target: within 5)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
