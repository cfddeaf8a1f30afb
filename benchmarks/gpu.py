"""One GPU: phalanx with 1 worker against the plain loop, fp32 and AMP, with and without device prefetch.

Run as ``python -m benchmarks.gpu --out DIR`` on a machine with CUDA; writes
``gpu.md`` and ``gpu.json``. Per model (ResNet-50 on ImageNet-shaped synthetic
images, ResNet-20 on CIFAR-shaped ones, a small GPT on random tokens) it times the
same training loop under

* setup: ``plain`` (the user's loop, no phalanx) or ``phalanx`` (``px.wrap`` with
  ``px.AllReduce()``, one worker);
* precision: ``fp32`` or ``bf16`` (``torch.autocast``);
* input: ``staged`` (batches already on the GPU: the upper bound), ``pageable`` (a
  DataLoader without pinned memory, ``x.to(device)`` in the loop: the common loop),
  ``pinned`` (``pin_memory=True`` and ``non_blocking=True`` on the default stream:
  PyTorch's recipe), ``prefetch`` (``px.shard(..., device=...)``: pinned, copied on
  a side stream one batch ahead).

The DataLoaders collate real per-sample tensors in worker processes, so input is
never pre-staged in the three loader modes. Every configuration is timed in windows
of ``--window`` steps bounded by ``torch.cuda.synchronize()``, after ``--warmup``
steps; configurations alternate over ``--repeats`` rounds so drift hits all alike.
"""
from __future__ import annotations

import argparse
import datetime
import gc
import os
import sys
import time
from typing import Any, Callable, Sequence

import torch
import torch.nn.functional as F

from phalanx.bench import models
from phalanx.bench import report, stats

MODELS: dict[str, dict[str, Any]] = {
    "resnet50": {"batch": 128, "build": models.resnet50, "shape": (3, 224, 224), "classes": 1000},
    "resnet20": {"batch": 128, "build": lambda: models.resnet_cifar(20), "shape": (3, 32, 32), "classes": 10},
    "gpt": {"batch": 32, "build": models.gpt, "tokens": (256, 8192)},
}
CONFIGS = [("plain", "staged"), ("phalanx", "staged"), ("plain", "pageable"), ("phalanx", "pageable"),
           ("phalanx", "pinned"), ("phalanx", "prefetch")]


class Synthetic(torch.utils.data.Dataset):
    """``length`` samples cycling over ``pool`` distinct random ones; each item is a fresh copy, as a decoder gives."""

    def __init__(self, spec: dict[str, Any], length: int, pool: int = 64, seed: int = 0) -> None:
        gen = torch.Generator().manual_seed(seed)
        if "tokens" in spec:
            t, vocab = spec["tokens"]
            self.x = torch.randint(vocab, (pool, t), generator=gen)
            self.y = torch.randint(vocab, (pool, t), generator=gen)
        else:
            self.x = torch.randn(pool, *spec["shape"], generator=gen)
            self.y = torch.randint(spec["classes"], (pool,), generator=gen)
        self.length, self.pool = length, pool

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i % self.pool].clone(), self.y[i % self.pool].clone()


def loss_of(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    if output.dim() == 3:  # a language model: every position predicts the next token
        return F.cross_entropy(output.flatten(0, 1).float(), target.flatten())
    return F.cross_entropy(output.float(), target)


def time_config(spec: dict[str, Any], setup: str, source: str, precision: str, *, loaders: dict[str, Any],
                staged: list[tuple[torch.Tensor, torch.Tensor]], warmup: int, windows: int, window: int,
                device: torch.device) -> list[float]:
    """Global samples/s of each timed window of one configuration (a fresh model and optimizer)."""
    import phalanx as px

    torch.manual_seed(0)
    model = spec["build"]().to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    if setup == "phalanx":
        model, opt = px.wrap(model, opt, strategy=px.AllReduce())
    dtype = torch.bfloat16 if precision == "bf16" else None
    batch = spec["batch"]
    total = warmup + windows * window
    if source == "staged":
        it: Any = (staged[i % len(staged)] for i in range(total))
    else:
        it = iter(loaders[source])

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        if source in ("pageable", "pinned"):
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=dtype or torch.float32, enabled=dtype is not None):
            loss = loss_of(model(x), y)
        loss.backward()
        opt.step()

    for _ in range(warmup):
        step(*next(it))
    out = []
    for _ in range(windows):
        torch.cuda.synchronize(device)
        start = time.perf_counter()
        for _ in range(window):
            step(*next(it))
        torch.cuda.synchronize(device)
        out.append(window * batch / (time.perf_counter() - start))
    for _ in it:  # let the loader finish its epoch, so the next iteration starts clean
        pass
    return out


def bench_model(name: str, *, warmup: int, windows: int, window: int, repeats: int, workers: int,
                configs: Sequence[tuple[str, str]] = CONFIGS, precisions: Sequence[str] = ("fp32", "bf16"),
                log: Callable[[str], None] = print) -> list[dict[str, Any]]:
    import phalanx as px

    device = px.device()
    spec = MODELS[name]
    batch = spec["batch"]
    length = (warmup + windows * window) * batch
    data = Synthetic(spec, length)
    kw = {"batch_size": batch, "shuffle": False, "rank": 0, "world_size": 1, "num_workers": workers,
          "persistent_workers": workers > 0, "prefetch_factor": 4 if workers else None}
    loaders = {"pageable": px.shard(data, pin_memory=False, **kw), "pinned": px.shard(data, pin_memory=True, **kw),
               "prefetch": px.shard(data, device=device, **kw)}
    staged = [tuple(t.to(device) for t in torch.utils.data.default_collate([data[i] for i in range(k, k + batch)]))
              for k in (0, batch)]
    windows_of: dict[tuple[str, str, str], list[float]] = {}
    runs = [(p, s, src) for p in precisions for s, src in configs]
    for k in range(repeats):
        for p, s, src in (runs if k % 2 == 0 else runs[::-1]):
            w = time_config(spec, s, src, p, loaders=loaders, staged=staged, warmup=warmup, windows=windows,
                            window=window, device=device)
            windows_of.setdefault((p, s, src), []).extend(w)
            log(f"  {name} {p} {s} {src}: {stats.summary(w)['median']:,.0f} samples/s")
            gc.collect()
            torch.cuda.empty_cache()
    del loaders
    rows = []
    for (p, s, src), w in windows_of.items():
        rows.append({"model": name, "precision": p, "setup": s, "input": src, "batch": batch,
                     "samples_per_s": stats.summary(w), "windows": w})
    med = {(r["precision"], r["setup"], r["input"]): r["samples_per_s"]["median"] for r in rows}
    for r in rows:
        p = r["precision"]
        plain = med.get((p, "plain", r["input"]))
        r["vs_plain"] = med[(p, r["setup"], r["input"])] / plain if plain and r["setup"] == "phalanx" else None
        pageable, pinned = med.get((p, r["setup"], "pageable")), med.get((p, r["setup"], "pinned"))
        mine = med[(p, r["setup"], r["input"])]
        r["vs_pageable"] = mine / pageable if pageable and r["input"] == "prefetch" else None
        r["vs_pinned"] = mine / pinned if pinned and r["input"] == "prefetch" else None
    return rows


def markdown(payload: dict[str, Any]) -> str:
    env = payload["environment"]
    o = payload["options"]
    lines = [f"# phalanx on one GPU: {payload['started']}\n\n", f"Command: `{payload['command']}`\n\n",
             f"Machine: {env['gpu']}, {env['cpu']} ({env['cpu_count']} cores), torch {env['torch']}. "
             f"Warm-up {o['warmup']} steps, then {o['windows']} windows of {o['window']} steps per configuration "
             f"and round, {o['repeats']} round(s) in alternating order; DataLoader worker processes: "
             f"{o['workers']}. SGD with momentum; `torch.backends.cudnn.benchmark = True`.\n\n",
             "| model | batch | precision | setup | input | samples/s (median) | spread (min–max of windows) | "
             "× plain loop, same input | prefetch × pageable | prefetch × pinned |\n"
             "|---|---|---|---|---|---|---|---|---|---|\n"]
    for r in payload["rows"]:
        s = r["samples_per_s"]
        lo, hi = min(r["windows"]), max(r["windows"])
        lines.append(f"| {r['model']} | {r['batch']} | {r['precision']} | {r['setup']} | {r['input']} | "
                     f"{s['median']:,.0f} | {lo:,.0f}–{hi:,.0f} | {report.fmt(r['vs_plain'], '.3f')} | "
                     f"{report.fmt(r['vs_pageable'], '.3f')} | {report.fmt(r['vs_pinned'], '.3f')} |\n")
    return "".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.gpu", description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="resnet50,resnet20,gpt")
    p.add_argument("--warmup", type=int, default=8)
    p.add_argument("--windows", type=int, default=4)
    p.add_argument("--window", type=int, default=8)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--workers", type=int, default=5, help="DataLoader worker processes")
    p.add_argument("--out", default="results/gpu")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("benchmarks.gpu: no CUDA device here; nothing measured", file=sys.stderr)
        return 2
    torch.backends.cudnn.benchmark = True
    os.makedirs(args.out, exist_ok=True)
    started = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    rows: list[dict[str, Any]] = []
    for name in [m.strip() for m in args.models.split(",") if m.strip()]:
        rows += bench_model(name, warmup=args.warmup, windows=args.windows, window=args.window,
                            repeats=args.repeats, workers=args.workers)
    payload = {"command": "python -m benchmarks.gpu " + " ".join(argv if argv is not None else sys.argv[1:]),
               "started": started, "environment": report.environment(["loopback"]), "options": vars(args),
               "rows": rows}
    report.write_json(os.path.join(args.out, "gpu.json"), payload)
    md = markdown(payload)
    with open(os.path.join(args.out, "gpu.md"), "w") as f:
        f.write(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
