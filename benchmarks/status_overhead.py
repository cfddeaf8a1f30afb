"""What ``phalanx run --status`` costs a training step: the reporting path measured directly, and jobs on/off.

    python benchmarks/status_overhead.py direct [--steps 200000]
    python benchmarks/status_overhead.py jobs [--repeat 4] [--steps 400] [--width 384]

``direct``: the work the reporter adds to each step, timed in one process on a real step
clock: the loader's ``input_waited`` and the clock's ``closed`` (a ``perf_counter``, one tuple
into a ring), in microseconds per step; and the reporter thread's once-a-second work
(``summary()`` of 50 steps, JSON, one ``store.set`` on a local TCPStore), in microseconds per
second, which is per step that figure over the steps per second.

``jobs``: ``phalanx run -n 2`` of a small MLP with a step of about 10 ms on this machine's
cores, ``--repeat`` times without and with ``--status``, interleaved (off, on, off, on, ...)
so the machine's drift hits both alike; each worker's median step time over its last steps.
Prints one line per run and the medians, and on/off.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import types


def direct(steps: int) -> None:
    import torch
    import torch.distributed as dist

    import phalanx as px
    from phalanx.step.telemetry import Reporter

    px.init()
    net = torch.nn.Linear(4, 1)
    _, opt = px.wrap(net, torch.optim.SGD(net.parameters(), lr=0.1))
    clock = px.strategy_of(opt).clock
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    group = types.SimpleNamespace(job_store=store, rank=0, generation=0, world_size=1)
    reporter = Reporter(group, "0")  # not started: its thread's work is timed below, by hand

    def per_step(with_reporter: bool) -> float:
        start = time.perf_counter()
        for i in range(steps):
            clock.step = i
            if with_reporter:
                reporter.input_waited(0.0001, 64, 0.5)
                reporter.closed(clock)
        return (time.perf_counter() - start) / steps * 1e6

    base = min(per_step(False) for _ in range(3))
    on = min(per_step(True) for _ in range(3))
    sends = []
    for _ in range(200):
        t = time.perf_counter()
        reporter.send()
        sends.append(time.perf_counter() - t)
    send_us = statistics.median(sends) * 1e6
    print(f"reporting path per step: {on - base:.2f} us (loop alone {base:.2f} us, with the reporter {on:.2f} us)")
    print(f"reporter thread, once a second: {send_us:.0f} us (summary of {len(reporter.steps)} steps + JSON + "
          f"store.set); at a 10 ms step that is {send_us / 100:.2f} us per step")
    print(f"total at a 10 ms step: {(on - base) + send_us / 100:.2f} us per step = "
          f"{((on - base) + send_us / 100) / 10_000 * 100:.3f} % of the step")


def worker(args: argparse.Namespace) -> None:
    import torch

    import phalanx as px

    px.init()
    torch.manual_seed(0)
    net = torch.nn.Sequential(*[torch.nn.Linear(args.width, args.width) for _ in range(3)])
    model, opt = px.wrap(net, torch.optim.SGD(net.parameters(), lr=1e-3))
    data = torch.utils.data.TensorDataset(torch.randn(64 * 64, args.width), torch.randn(64 * 64, args.width))
    loader = px.shard(data, batch_size=64, seed=0)
    times, last, epoch = [], None, 0
    while len(times) < args.steps:
        loader.set_epoch(epoch)
        epoch += 1
        for x, y in loader:
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            now = time.perf_counter()
            if last is not None:
                times.append(now - last)
            last = now
            if len(times) >= args.steps:
                break
    with open(os.path.join(args.out, f"w{px.rank()}.json"), "w") as f:
        json.dump(times[args.steps // 4:], f)  # the first quarter warms up


def jobs(args: argparse.Namespace) -> None:
    cli = [sys.executable, "-c", "import sys; from phalanx.cli import main; sys.exit(main())"]
    rows: dict[bool, list[float]] = {False: [], True: []}
    for i in range(2 * args.repeat):
        status = i % 2 == 1
        out = tempfile.mkdtemp(prefix="status-overhead-")
        flags = []
        if status:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                flags = ["--status", str(s.getsockname()[1])]
        subprocess.run([*cli, "run", "-n", "2", *flags, __file__, "worker", "--out", out, "--steps",
                        str(args.steps), "--width", str(args.width)], check=True, stderr=subprocess.DEVNULL)
        step = statistics.median(t for r in (0, 1) for t in json.load(open(os.path.join(out, f"w{r}.json"))))
        rows[status].append(step)
        print(f"run {i + 1}: --status {'on ' if status else 'off'} median step {step * 1e3:.3f} ms", flush=True)
    off, on = statistics.median(rows[False]), statistics.median(rows[True])
    print(f"median of {args.repeat} runs each: off {off * 1e3:.3f} ms, on {on * 1e3:.3f} ms, on/off {on / off:.3f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("mode", choices=("direct", "jobs", "worker"))
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--repeat", type=int, default=4)
    p.add_argument("--width", type=int, default=384)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if args.mode == "direct":
        direct(args.steps or 200_000)
    elif args.mode == "worker":
        worker(args)
    else:
        args.steps = args.steps or 400
        jobs(args)


if __name__ == "__main__":
    main()
