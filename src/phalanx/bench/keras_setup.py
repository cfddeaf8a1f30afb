"""``phalanx bench --keras``: Keras 3 through ``px.keras`` beside the same model in plain PyTorch.

Six setups train the same MLP (784 -> depth x width -> 10, SGD, synthetic data), each
in fresh processes with one intra-op thread per worker, interleaved over the repeats
so that a drift of the machine hits every setup alike:

* plain Keras ``model.fit`` on 1 process; phalanx-Keras (``px.keras.wrap``) on 1 and 2 workers;
* the same model in plain PyTorch on 1 process; phalanx (``px.wrap``) on 1 and 2 workers.

It prints samples/s (median and min-max of the repeats), the wrapper overhead on 1
worker (target <= 3%) and the 2-worker efficiency of both paths (rate over twice the
plain 1-process rate of the same framework; target: Keras within 5 points of PyTorch),
and writes every figure to ``keras.json`` in ``--out``.

Example:
    phalanx bench --keras --repeats 3 --out results/keras
    phalanx bench --keras --steps 8 --warmup 2 --repeats 1 --width 64 --depth 2 --out /tmp/k   # seconds
"""
from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import time
from typing import Any, Sequence

from ..errors import ConfigError, usage
from .report import run_header, write_report

# (framework, wrapped by phalanx, workers)
SETUPS = [("keras", False, 1), ("keras", True, 1), ("keras", True, 2),
          ("torch", False, 1), ("torch", True, 1), ("torch", True, 2)]


def label(framework: str, wrapped: bool) -> str:
    if framework == "keras":
        return "phalanx-Keras" if wrapped else "plain Keras"
    return "phalanx (PyTorch)" if wrapped else "plain PyTorch"


def worker(framework: str, wrapped: bool, steps: int, warmup: int, batch: int, width: int, depth: int) -> float:
    """One worker's timed run (under ``phalanx.bench.procs.run_workers``); returns all workers' samples/s."""
    os.environ.setdefault("KERAS_BACKEND", "torch")
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
        from ..keras.keras_api import keras
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
        module: nn.Module = net
        if wrapped:
            module, opt = px.wrap(net, opt)
        data = torch.utils.data.TensorDataset(torch.from_numpy(x), torch.from_numpy(y))
        loader = px.shard(data, batch_size=batch, shuffle=False) if wrapped else \
            torch.utils.data.DataLoader(data, batch_size=batch)
        for xb, yb in loader:
            opt.zero_grad()
            nn.functional.cross_entropy(module(xb), yb).backward()
            opt.step()
            marks.append(time.perf_counter())
    timed = marks[max(0, warmup - 1):]
    return (len(timed) - 1) * batch * world / (timed[-1] - timed[0])


def measure(framework: str, wrapped: bool, workers: int, args: argparse.Namespace) -> float:
    from .procs import run_workers
    kwargs = dict(framework=framework, wrapped=wrapped, steps=args.steps, warmup=args.warmup, batch=args.batch,
                  width=args.width, depth=args.depth)
    env = {} if wrapped else {"WORLD_SIZE": "1", "RANK": "0", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"}
    return run_workers("phalanx.bench.keras_setup:worker", world_size=workers, timeout=args.timeout, env=env,
                       **kwargs).results[0]


def summarise(rates: dict[tuple[str, bool, int], list[float]]) -> dict[str, Any]:
    """Medians, spreads, overhead and efficiencies from the samples/s of every repeat."""
    med = {k: statistics.median(v) for k, v in rates.items()}
    rows = [{"setup": label(fw, wrapped), "framework": fw, "wrapped": wrapped, "workers": n,
             "median": med[(fw, wrapped, n)], "min": min(v), "max": max(v), "repeats": v}
            for (fw, wrapped, n), v in rates.items()]
    eff = {fw: med[(fw, True, 2)] / (2 * med[(fw, False, 1)]) for fw in ("keras", "torch")}
    return {"rows": rows, "overhead_1_worker": 1 - med[("keras", True, 1)] / med[("keras", False, 1)],
            "torch_overhead_1_worker": 1 - med[("torch", True, 1)] / med[("torch", False, 1)],
            "efficiency_2_workers": eff, "gap_points": 100 * (eff["keras"] - eff["torch"])}


def markdown(summary: dict[str, Any], args: argparse.Namespace) -> str:
    lines = [f"MLP 784-{args.depth}x{args.width}-10, batch {args.batch} per worker, {args.steps} timed steps after "
             f"{args.warmup}, {args.repeats} repeat(s); samples/s of all workers together\n",
             "| setup | workers | samples/s (median) | min-max |", "|---|--:|--:|--:|"]
    lines += [f"| {r['setup']} | {r['workers']} | {r['median']:,.0f} | {r['min']:,.0f}-{r['max']:,.0f} |"
              for r in summary["rows"]]
    eff = summary["efficiency_2_workers"]
    lines += ["", f"wrapper overhead, 1 worker: Keras {summary['overhead_1_worker']:+.1%} (target <= 3%), "
                  f"PyTorch {summary['torch_overhead_1_worker']:+.1%}",
              f"efficiency on 2 workers: Keras {eff['keras']:.0%}, PyTorch {eff['torch']:.0%}: "
              f"{summary['gap_points']:+.0f} points (target: within 5)"]
    return "\n".join(lines) + "\n"


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="phalanx bench --keras", description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=60, help="timed steps per run (default 60)")
    p.add_argument("--warmup", type=int, default=10, help="untimed steps first (default 10)")
    p.add_argument("--batch", type=int, default=64, help="samples per worker per step (default 64)")
    p.add_argument("--width", type=int, default=1024, help="hidden width (default 1024)")
    p.add_argument("--depth", type=int, default=5, help="hidden layers (default 5)")
    p.add_argument("--repeats", type=int, default=3, help="runs per setup, interleaved (default 3)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per run before it is killed")
    p.add_argument("--out", default="results/keras", help="output directory (keras.json, keras.md)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    if min(args.steps, args.batch, args.width, args.depth, args.repeats) < 1 or args.warmup < 1:
        raise ConfigError(usage(f"--steps {args.steps} --warmup {args.warmup} --batch {args.batch} --width "
                                f"{args.width} --depth {args.depth} --repeats {args.repeats}",
                                "every number >= 1", "Fix the numbers (--warmup 1 at least: the first step "
                                "builds Keras's training function)."))
    os.environ.setdefault("KERAS_BACKEND", "torch")
    from ..keras.keras_api import check_backend
    check_backend()  # one clear message for Keras on another backend, before any worker starts
    started = datetime.datetime.now(datetime.timezone.utc)
    rates: dict[tuple[str, bool, int], list[float]] = {s: [] for s in SETUPS}
    for r in range(args.repeats):
        for setup in SETUPS:
            rates[setup].append(measure(*setup, args))
            print(f"repeat {r + 1}/{args.repeats}: {label(*setup[:2])} x{setup[2]}: "
                  f"{rates[setup][-1]:,.0f} samples/s", file=sys.stderr, flush=True)
    summary = summarise(rates)
    header = run_header("phalanx bench --keras", argv, started.isoformat(timespec="seconds"), args)
    write_report(args.out, "keras", {**header, **summary}, markdown(summary, args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
