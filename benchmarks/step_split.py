"""Where a rule's step goes on a shaped link, for one of ``benchmarks/quality``'s models: docs/strategies.md ("Auto").

    phalanx run -n 2 --link 10mbit benchmarks/step_split.py lstm s8f4 60      # as root; 100mbit, 1gbit likewise

TASK is ``gpt``, ``lstm`` or ``resnet20`` (the quality benchmark's models, optimizers and batches, one thread a
worker); RULE one of :data:`RULES`; STEPS the steps to train. Rank 0 prints the median and mean step after the first
5, the mean time its step clock counted as waiting on the exchange, the first 8 steps (``px.Auto``'s probe is there)
and Auto's line; the launcher then prints the step split and the bytes on the wire. ``--profile`` adds rank 0's
cProfile of steps 10 to the end (``--early``: of steps 1-3).
"""
from __future__ import annotations

import cProfile
import io
import os
import pstats
import statistics
import sys
import time
from typing import Any, Callable

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run as a script by `phalanx run`

import phalanx as px  # noqa: E402
from benchmarks.quality.tasks import get  # noqa: E402


def _streaming(every: int, parts: int, cut: str = "tensors") -> Any:
    """Auto's streamed rule: one step of overlap, 4-bit, plain averaging."""
    return px.StreamingDiLoCo(every=every, fragments=parts, overlap=1, quantize=4, outer_lr=1.0, outer_momentum=0.0,
                              cut=cut)


#: The rules by short name: ``local`` sends nothing (DiLoCo whose first outer step is past any run).
RULES: dict[str, Callable[[], Any]] = {
    "local": lambda: px.DiLoCo(every=10**6),
    "s4f2": lambda: _streaming(4, 2), "s4f4": lambda: _streaming(4, 4), "s8f4": lambda: _streaming(8, 4),
    "s16f2": lambda: _streaming(16, 2), "s64f2": lambda: _streaming(64, 2),
    "s8f4v": lambda: _streaming(8, 4, "values"), "s8f8v": lambda: _streaming(8, 8, "values"),
    "ar": lambda: px.AllReduce(),
    "ar4": lambda: px.AllReduce(compression=px.Quantize(4, block=256, error_feedback=True)),
    "auto": lambda: px.Auto(planned_steps=200),
}


def main(argv: list[str]) -> None:
    task_name, rule, steps = argv[0], argv[1], int(argv[2])
    profile, early = "--profile" in argv, "--early" in argv
    torch.set_num_threads(1)
    px.init()
    task = get(task_name)
    torch.manual_seed(0)
    net = task.model()
    model, opt = px.wrap(net, task.optim.build(net.parameters(), task.optim.lr), strategy=RULES[rule]())
    strategy = px.strategy_of(opt)
    clock = strategy.clock
    prof = cProfile.Profile() if profile and px.rank() == 0 else None
    first, last = (1, 3) if early else (10, steps)
    times, waits = [], []
    for s in range(1, steps + 1):
        x, y = task.batch(s, px.rank(), px.world_size(), task.per_worker)
        if prof is not None and s == first:
            prof.enable()
        t0, w0 = time.perf_counter(), clock.waited
        opt.zero_grad()
        task.loss(model(x), y).backward()
        opt.step()
        times.append(time.perf_counter() - t0)
        waits.append(clock.waited - w0)
        if prof is not None and s == last:
            prof.disable()
    if px.rank() == 0:
        t, w = times[5:], waits[5:]
        print(f"step_split {task_name} {rule}: step {1e3 * statistics.median(t):.1f} ms median, "
              f"{1e3 * statistics.mean(t):.1f} mean, waiting {1e3 * statistics.mean(w):.1f} ms mean; "
              f"first steps {[round(1e3 * x) for x in times[:8]]} ms", flush=True)
        for entry in getattr(strategy, "schedule", []):
            print(entry["line"], flush=True)
        if prof is not None:
            out = io.StringIO()
            pstats.Stats(prof, stream=out).sort_stats("cumulative").print_stats(35)
            print(out.getvalue(), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
