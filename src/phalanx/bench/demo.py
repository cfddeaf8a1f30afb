"""``phalanx demo``: the same training on 1 worker and on 2, side by side.

A small CNN learns scikit-learn's bundled 8x8 handwritten digits (no download)
with :class:`phalanx.Trainer`, first as one process, then as two worker
processes that average gradients every step. Each worker keeps the batch size,
so two workers take half the steps per epoch on twice the samples per step. The
demo ends with a table of test accuracy, samples/s, speedup and efficiency.

Workers run on CPU, one intra-op thread each, and only rank 0 prints. Run
``phalanx demo --help`` for the knobs.
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Any

from ..errors import OneLineParser
from .demo_table import MIN_ACCURACY, table  # noqa: F401  (table: re-exported for callers of this module)
from ..launch.workers import START_METHODS, StartMethod, start_worker
from .procs import free_port



def train(*, epochs: int = 10, batch_size: int = 128, lr: float = 3e-3, seed: int = 0, progress: bool = True,
          limit: int | None = None) -> dict[str, Any]:
    """One worker's part of a demo run (call it on every worker); returns the run's summary.

    ``limit`` keeps only the first ``limit`` training samples (for quick tests).
    """
    import torch
    import torch.nn.functional as F

    import phalanx as px
    from phalanx.bench.models import digits_cnn, load_digits_split
    from phalanx.train.trainer import Trainer

    px.init()
    torch.manual_seed(seed)
    train_set, test_set = load_digits_split()
    if limit is not None:
        train_set = torch.utils.data.Subset(train_set, range(min(limit, len(train_set))))
    model = digits_cnn()
    trainer = Trainer(model, torch.optim.Adam(model.parameters(), lr=lr), F.cross_entropy, metrics=["accuracy"])
    history = trainer.fit(train_set, epochs=epochs, batch_size=batch_size, val_data=test_set, seed=seed,
                          progress=progress)
    last = history[-1]
    return {"workers": px.world_size(), "test_accuracy": last["val_accuracy"], "test_samples": last["val_samples"],
            "samples_per_s": history.samples_per_s, "train_samples": len(train_set), "epochs": epochs,
            "seconds": sum(history["time_s"])}


def _launch(workers: int, worker_args: list[str], threads: int, start_method: StartMethod = "spawn") -> int:
    """Start ``workers`` local worker processes of this module; the first failure's code, else 0.

    The variables are the ones ``phalanx run`` and torchrun set, so the workers are
    ordinary phalanx scripts. A single worker gets none: it is a plain process.
    ``start_method`` (:mod:`phalanx.launch.workers`): a fresh interpreter per worker, or a
    fork of a server that imported torch once.
    """
    group_vars = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    base = {k: v for k, v in os.environ.items() if k not in group_vars and not k.startswith("TORCHELASTIC_")}
    base.update(OMP_NUM_THREADS=str(threads), PHALANX_THREADS=str(threads),
                CUDA_VISIBLE_DEVICES="")  # the demo is about CPU workers
    port = free_port()
    procs = []
    for rank in range(workers):
        env = dict(base)
        if workers > 1:
            env.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(workers), LOCAL_WORLD_SIZE=str(workers),
                       MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        procs.append(start_worker(start_method, ["-m", "phalanx.bench.demo", "--worker", *worker_args], env))
    try:
        while True:
            codes = [p.poll() for p in procs]
            failed = [c for c in codes if c not in (None, 0)]
            if failed or all(c == 0 for c in codes):
                break
            time.sleep(0.05)
    except KeyboardInterrupt:
        failed = [130]
    for p in procs:  # after a failure, stop the rest rather than let them wait on a dead peer
        if p.poll() is None:
            p.terminate()
    for p in procs:
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
    return failed[0] if failed else 0


def _parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="phalanx demo", usage_hint="`phalanx demo [--epochs N] [--workers N ...] ...`",
                      description="Train a small CNN on scikit-learn's digits on "
                                "1 worker, then on 2, and compare accuracy and speed.")
    p.add_argument("--epochs", type=int, default=10, help="epochs per run (default 10)")
    p.add_argument("--batch-size", type=int, default=128, help="samples per worker per step (default 128)")
    p.add_argument("--lr", type=float, default=3e-3, help="Adam learning rate (default 3e-3)")
    p.add_argument("--workers", type=int, nargs="+", default=[1, 2], help="worker counts to run (default: 1 2)")
    p.add_argument("--threads", type=int, default=1, help="intra-op threads per worker (default 1)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--start-method", choices=START_METHODS, default=None,
                   help="how each worker starts: spawn (a fresh interpreter, the default) or forkserver (a fork of a "
                        "server that imported torch once); PHALANX_START_METHOD sets it too, as for "
                        "`phalanx run --elastic`")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)  # internal: run as one worker
    p.add_argument("--limit", type=int, default=None, help=argparse.SUPPRESS)  # internal: fewer training samples
    p.add_argument("--out", default=None, help=argparse.SUPPRESS)  # internal: where rank 0 writes its summary
    return p


def main(argv: list[str] | None = None) -> int:
    """Run the demo (or, with the internal ``--worker``, one of its workers); returns the exit status."""
    if argv is None:
        argv = sys.argv[1:]
    if "--keras" in argv:  # the same demo with a Keras 3 model: phalanx.bench.keras_demo
        from .keras_demo import main as keras_demo
        return keras_demo([a for a in argv if a != "--keras"])
    if "--stream" in argv:  # `phalanx demo --stream`: phalanx.bench.stream_demo
        return importlib.import_module("phalanx.bench.stream_demo").main([x for x in argv if x != "--stream"])
    args = _parser().parse_args(argv)
    for name in ("epochs", "batch_size", "threads"):
        if getattr(args, name) < 1:
            print(f"phalanx demo: --{name.replace('_', '-')}={getattr(args, name)}; expected an integer >= 1.",
                  file=sys.stderr)
            return 2
    if any(n < 1 for n in args.workers):
        print(f"phalanx demo: --workers {args.workers}; expected counts >= 1.", file=sys.stderr)
        return 2
    if args.worker:
        return _worker(args)
    method = args.start_method or os.environ.get("PHALANX_START_METHOD") or "spawn"
    if method not in START_METHODS:
        print(f"phalanx demo: PHALANX_START_METHOD={method}; expected spawn or forkserver. Set it to one of those, "
              "or unset it.", file=sys.stderr)
        return 2

    runs = ", then on ".join(_plural(n, "worker") for n in args.workers)
    print(f"phalanx demo: a small CNN learns scikit-learn's handwritten digits (bundled, no download) on {runs}.\n"
          f"Each worker is a CPU process with {_plural(args.threads, 'thread')} and a batch of {args.batch_size}; "
          f"{_plural(args.epochs, 'epoch')}; gradients are averaged every step.", flush=True)
    rows = []
    with tempfile.TemporaryDirectory(prefix="phalanx-demo-") as tmp:
        for n in args.workers:
            out = os.path.join(tmp, f"{n}.json")
            print(f"\n== {_plural(n, 'worker')} ==", flush=True)
            worker_args = ["--epochs", str(args.epochs), "--batch-size", str(args.batch_size), "--lr", str(args.lr),
                           "--seed", str(args.seed), "--out", out]
            if args.no_progress:
                worker_args.append("--no-progress")
            if args.limit is not None:
                worker_args += ["--limit", str(args.limit)]
            code = _launch(n, worker_args, args.threads, method)
            if code != 0:
                print(f"phalanx demo: the {n}-worker run failed (exit status {code}); see the messages above.",
                      file=sys.stderr)
                return code if code > 0 else 1
            with open(out) as f:
                rows.append(json.load(f))
    first = rows[0]
    print(f"\n{first['train_samples']} training / {first['test_samples']} test images. samples/s: all workers "
          "together, warm-up steps excluded. efficiency: speedup / workers.\n")
    print(table(rows), flush=True)
    low = [r for r in rows if r["test_accuracy"] < MIN_ACCURACY]
    if low and args.limit is None:
        print(f"\nphalanx demo: test accuracy below {MIN_ACCURACY} for "
              f"{', '.join(str(r['workers']) for r in low)} worker(s); expected at least {MIN_ACCURACY}.",
              file=sys.stderr)
        return 1
    return 0


def _plural(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"


def _worker(args: argparse.Namespace) -> int:
    import phalanx as px
    try:
        summary = train(epochs=args.epochs, batch_size=args.batch_size, lr=args.lr, seed=args.seed,
                        progress=not args.no_progress, limit=args.limit)
        if px.is_main() and args.out:
            with open(args.out, "w") as f:
                json.dump(summary, f)
    except px.PhalanxError as err:
        print(f"phalanx demo (rank {px.rank() if px.is_initialized() else '?'}): {err}", file=sys.stderr)
        return 1
    finally:
        px.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
