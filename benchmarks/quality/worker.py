"""One worker of a quality session: ``python -m benchmarks.quality.worker CONFIG.json OUT.jsonl``.

A session is a list of runs (setup, seed, lr, budget) trained one after the other in the
same two processes, on one process group: the interpreter start, the torch import and the
group's rendezvous are paid once per session instead of once per run. Every run rebuilds
its model (from its seed), optimizer, strategy or DDP wrapper and accountant, so nothing
carries over from one run to the next (compressors' residuals, comm hooks, momentum);
``tests/benchmarks/test_quality.py`` checks that a run repeated after another setup gives the same
curve. Each finished run is appended to OUT.jsonl as one line at once, so the launcher
sees progress and a lost session loses only the run in flight.

The training clock counts only the training steps (forward, backward, the strategy's
exchange, the optimizer step); drawing the batch and evaluating are outside it and
the same for every setup. Every ``check_every`` steps rank 0 broadcasts one decision
(evaluate now? stop?), so every rank takes the same number of steps and periodic
strategies never hang; rank 0 evaluates on a regular grid and at every check once close
to the target (:class:`EvalSchedule`). Quality is rank 0's replica at that moment (or, for a task with an
``ema_decay``, the moving average of its weights, updated after every step outside the
clock); after the budget ``finish()`` makes the model to keep (last average, EASGD's
centre), whose quality is the run's final quality.
"""
from __future__ import annotations

import gc
import json
import os
import sys
import time
from typing import Any

import torch
import torch.distributed as dist

from phalanx.bench.worker import wire_bytes
from .setups import SETUPS
from .tasks import get


def _decide(rank: int, flags: list[bool]) -> list[bool]:
    """Rank 0's flags, the same on every worker (outside the training clock)."""
    if not dist.is_initialized():
        return flags
    t = torch.tensor([1.0 if f else 0.0 for f in flags])
    dist.broadcast(t, 0)
    return [bool(v) for v in t.tolist()]


class EvalSchedule:
    """When rank 0 evaluates: every ``budget / evals`` of training time, and at every check once close to the target.

    A time to target is read at the first evaluation that meets the target, so it overshoots by up to one
    interval between evaluations (the GPT: ~8 steps, 7% of its bound). Once an evaluation comes within the
    task's ``near_band`` of the target, every check (``check_every`` steps) evaluates until the target is met:
    the overshoot is then at most one check, for every setup alike, for a few more evaluations per run.

    Example:
        >>> from benchmarks.quality.tasks import get
        >>> s = EvalSchedule(budget=10.0, evals=5, task=get("gpt"))   # every 2 s; the GPT's band: 0.08 nats
        >>> s.due(1.0), s.due(2.0)
        (False, True)
        >>> s.record(2.0, 2.90); s.due(2.5)       # 0.15 from the target 2.75: the next at 4 s
        False
        >>> s.record(4.0, 2.78); s.due(4.2)       # within the band: every check from now on
        True
        >>> s.record(4.2, 2.74); s.due(4.4)       # met: back to the regular grid
        False
    """

    def __init__(self, budget: float, evals: int, task: Any) -> None:
        self.interval, self.next, self.task, self.near = budget / evals, budget / evals, task, False

    def due(self, clock: float) -> bool:
        return clock >= self.next or self.near

    def record(self, clock: float, quality: float) -> None:
        if clock >= self.next:
            self.next += self.interval
        self.near = self.task.near(quality)


def run(cfg: dict[str, Any]) -> dict[str, Any]:
    torch.set_num_threads(int(cfg.get("threads", 1)))
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    task, setup = get(cfg["task"]), SETUPS[cfg["setup"]]
    budget, max_steps = float(cfg["budget_s"]), int(cfg.get("max_steps") or 0)
    evals, check_every, per_worker = int(cfg.get("evals", 12)), int(cfg.get("check_every", 4)), int(cfg["per_worker"])
    torch.manual_seed(int(cfg.get("seed", 0)))  # the same initial model for every setup and rank
    model = task.model()
    family = setup.optim or task.optim.name
    opt = type(task.optim)(family, task.base_lr(family)).build(model.parameters(), float(cfg["lr"]))
    # The weights, or their moving average, updated outside the clock; made before the setup wraps the model (a
    # wrapped one holds its process group, which the average's copy could not take).
    judged = task.judged(model)
    module, opt, acc = setup.build(model, opt, float(cfg["lr"]))
    if dist.is_initialized():
        dist.barrier()
    curve: list[tuple[float, int, float]] = [(0.0, 0, task.evaluate(judged.module) if rank == 0 else float("nan"))]
    bytes0, wire0 = acc.bytes_sent(), wire_bytes()
    clock, step, schedule = 0.0, 0, EvalSchedule(budget, evals, task)
    # Steps to target (benchmarks/levers.py): evaluate every ``eval_every`` steps, every check once within
    # ``near_band`` of the target, and stop once the target is met; the training clock plays no part.
    eval_every, stop_at_target = int(cfg.get("eval_every") or 0), bool(cfg.get("stop_at_target"))
    band, near, reached = float(cfg.get("near_band") or 0.0), False, False
    while True:
        x, y = task.batch(step, rank, world, per_worker)
        start = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        task.loss(module(x), y).backward()
        opt.step()
        clock += time.perf_counter() - start
        step += 1
        judged.update()
        if step % check_every:
            continue
        done = clock >= budget or (max_steps and step >= max_steps) or reached
        due = (step % eval_every == 0 or near) if eval_every else schedule.due(clock)
        evaluate, stop = _decide(rank, [bool(done or due), bool(done)])  # rank 0's schedule
        if evaluate and rank == 0 and not stop:  # the final point is taken after finish()
            curve.append((clock, step, task.evaluate(judged.module)))
            schedule.record(clock, curve[-1][2])
            met = task.reached(curve[-1][2], task.target)
            near = not met and abs(curve[-1][2] - task.target) <= band
            reached = stop_at_target and met
        if stop:
            break
    wire_end = wire_bytes()
    counted = acc.bytes_sent() - bytes0
    acc.finish()  # the model to keep: last average, EASGD's centre
    judged.update()  # the model to keep enters the average as one more step would
    final = task.evaluate(judged.module) if rank == 0 else float("nan")
    if rank == 0:
        curve.append((clock, step, final))
    result = {"rank": rank, "world_size": world, "task": task.name, "setup": setup.name, "lr": cfg["lr"],
              "curve": curve, "steps": step, "train_seconds": clock, "final": final,
              "samples_per_s": world * per_worker * step / clock if clock > 0 else float("nan"),
              "bytes_per_step": counted / max(step, 1),
              "wire_bytes_per_step": (wire_end - wire0) / max(step, 1) if wire_end is not None else None,
              # px.Auto's choices (step, rule and settings, its line), where the setup is Auto
              "schedule": getattr(getattr(acc, "strategy", None), "schedule", None)}
    if dist.is_initialized():
        dist.barrier()
    return result


def session(argv: list[str]) -> int:
    """``CONFIG.json OUT.jsonl``: every run of ``config["runs"]`` from ``config["start"]`` on, one line each."""
    with open(argv[0]) as f:
        cfg = json.load(f)
    if int(os.environ.get("WORLD_SIZE", 1)) > 1:
        import phalanx as px

        px.init()  # one group for the whole session; DDP and phalanx's strategies share it
    with open(argv[1], "a") as out:
        for index in range(int(cfg.get("start", 0)), len(cfg["runs"])):
            start = time.perf_counter()
            result = run(cfg["runs"][index])
            result.update(index=index, wall_s=time.perf_counter() - start)
            out.write(json.dumps(result) + "\n")
            out.flush()
            gc.collect()  # the last run's model, optimizer and wrappers go before the next one is timed
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(session(sys.argv[1:]))
