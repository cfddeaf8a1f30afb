"""Time to a fixed test accuracy: the digits CNN on scikit-learn's bundled digits, per setup.

Throughput alone flatters rules that talk less (local SGD, compression): they take
more steps to the same accuracy. This measures what a user waits for: training
time (evaluation excluded) until rank 0's replica first reaches the target test
accuracy, checked every ``eval_every`` steps. Every setup sees the same data
order (:func:`phalanx.data.sampler.global_batches`), the same seeds and the same optimizer.

Run as ``python -m phalanx.bench.tta CONFIG.json OUT.json``, one process per rank.
"""
from __future__ import annotations

import math
import os
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..data.sampler import global_batches
from .models import digits_cnn, load_digits_split
from .report import fmt, fmt_bytes, setup_name
from .spec import Setup
from .worker import main, setup_training, wire_bytes

DEFAULTS = {"target": 0.95, "max_epochs": 30, "batch": 32, "lr": 0.05, "eval_every": 10}


def run(cfg: dict[str, Any]) -> dict[str, Any]:
    cfg = {**DEFAULTS, **cfg}
    torch.set_num_threads(int(cfg.get("threads", 1)))
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    torch.manual_seed(cfg.get("seed", 0))
    model = digits_cnn()
    opt = torch.optim.SGD(model.parameters(), lr=cfg["lr"], momentum=0.9)
    module, acc = setup_training(Setup(cfg["setup"]["name"], cfg["setup"].get("kwargs", {})), model, opt)
    train, test = load_digits_split()
    (tx, ty), (vx, vy) = train.tensors, test.tensors
    clock, steps, curve, reached = 0.0, 0, [], None
    bytes0, wire0 = acc.bytes_sent(), wire_bytes()
    for epoch in range(cfg["max_epochs"]):
        for parts in global_batches(len(tx), cfg["batch"], world, shuffle=True, seed=cfg.get("seed", 0), epoch=epoch):
            idx = torch.tensor(parts[rank], dtype=torch.long)  # a part of the short last step may be empty
            start = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            F.cross_entropy(module(tx[idx]), ty[idx]).backward()
            opt.step()
            clock += time.perf_counter() - start
            steps += 1
            if steps % cfg["eval_every"] == 0:
                accuracy = _evaluate(model, vx, vy) if rank == 0 else math.nan
                if rank == 0:
                    curve.append((clock, steps, accuracy))
                if _agree(rank == 0 and accuracy >= cfg["target"]):
                    reached = {"seconds": clock, "steps": steps, "epoch": epoch + 1, "accuracy": accuracy}
                    break
        if reached:
            break
    wire_end = wire_bytes()
    acc.finish()
    result = {"rank": rank, "world_size": world, "target": cfg["target"], "reached": reached, "curve": curve,
              "steps": steps, "train_seconds": clock, "batch": cfg["batch"],
              "bytes_per_step": (acc.bytes_sent() - bytes0) / max(steps, 1),
              "wire_bytes_per_step": (wire_end - wire0) / max(steps, 1) if wire_end is not None else None}
    if dist.is_initialized():
        dist.barrier()
    return result


@torch.no_grad()
def _evaluate(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    was = model.training
    model.eval()
    correct = (model(x).argmax(1) == y).sum().item()
    model.train(was)
    return correct / len(y)


def _agree(stop: bool) -> bool:
    """Rank 0's decision, the same on every worker (outside the training clock)."""
    if not dist.is_initialized():
        return stop
    flag = torch.tensor([1.0 if stop else 0.0])
    dist.broadcast(flag, 0)
    return bool(flag.item())


def config(run: Any, opts: Any, **overrides: Any) -> dict[str, Any]:
    return {**DEFAULTS, "setup": {"name": run.setup.name, "kwargs": run.setup.kwargs}, "seed": opts.seed,
            "threads": run.threads, **overrides}


def rows(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (setup, workers, link): median seconds to the target over repeats, and how each compares to DDP."""
    from collections import defaultdict
    from statistics import median

    groups: dict[tuple, list[dict[str, Any]]] = defaultdict(list)
    for rec in records:
        r = rec["run"]
        groups[(r["setup"]["label"], r["setup"]["name"], r["workers"], r["link"])].append(rec)
    out = []
    for (label, name, n, link), recs in groups.items():
        ok = [rec["ranks"][0] for rec in recs if not rec["error"] and rec["ranks"]]
        hit = [r["reached"] for r in ok if r["reached"]]
        rank0 = ok[0] if ok else {}
        out.append({"setup": label, "kind": Setup(name).kind, "workers": n, "link": link, "runs": len(recs),
                    "reached": len(hit), "seconds": median(h["seconds"] for h in hit) if hit else math.nan,
                    "steps": median(h["steps"] for h in hit) if hit else math.nan,
                    "epochs": median(h["epoch"] for h in hit) if hit else math.nan,
                    "target": rank0.get("target"), "bytes_per_step": rank0.get("bytes_per_step"),
                    "wire_bytes_per_step": rank0.get("wire_bytes_per_step"),
                    "final_accuracy": rank0["curve"][-1][2] if rank0.get("curve") else math.nan,
                    "errors": [rec["error"] for rec in recs if rec["error"]]})
    for row in out:
        ddp = next((r for r in out if r["setup"] == "ddp" and r["workers"] == row["workers"]
                    and r["link"] == row["link"]), None)
        row["vs_ddp"] = ddp["seconds"] / row["seconds"] if ddp and row["seconds"] > 0 else math.nan
    return out


def table(tta_rows: list[dict[str, Any]]) -> str:
    head = ("| setup | link | workers | time to target (s) | steps | epochs | reached | bytes/step | "
            "wire bytes/step | × sooner than DDP |\n|---|---|---|---|---|---|---|---|---|---|\n")
    lines = []
    for r in tta_rows:
        if r["errors"] and not r["reached"]:
            lines.append(f"| {setup_name(r)} | {r['link']} | {r['workers']} | failed: {r['errors'][0][:100]} "
                         "| | | | | | |")
            continue
        lines.append(f"| {setup_name(r)} | {r['link']} | {r['workers']} | {fmt(r['seconds'], '.2f', 'not reached')} | "
                     f"{fmt(r['steps'], '.0f')} | {fmt(r['epochs'], '.0f')} | {r['reached']}/{r['runs']} | "
                     f"{fmt_bytes(r['bytes_per_step'])} | {fmt_bytes(r['wire_bytes_per_step'])} | "
                     f"{fmt(r['vs_ddp'], '.2f')} |")
    return head + "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:], run))
