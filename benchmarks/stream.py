"""Streaming throughput: 2 workers train the digits CNN from a Redis stream, and from memory, side by side.

    python benchmarks/stream.py --out results/stream   # 148 s on 2 shared cores at load 7-8 (under 4 minutes)

A real redis-server starts on a unix socket in a temporary directory, and ``--events`` digits
images are published to one stream at full speed (pipelined XADD, ending with the end-of-stream
marker) before the workers start, so each run drains a backlog and measures what the workers
consume. One group of 2 workers (gloo, one thread each) then runs, for every repeat, the same
training twice: from the stream (``px.stream.StreamLoader``, through a consumer group of the
repeat's own) and from an in-memory dataset of the same images in the same order (``px.shard``),
the order alternating between repeats so that drift in the machine's speed hits both alike. Each
run starts from the same initial model and runs the same loop. Rates are global events (samples)
per second, timed from the end of the ``--warmup``-th step to the last step on the slower
worker's clock. The overhead of a repeat is ``1 - stream/memory`` from its two runs; the table
gives the median and the min-max over repeats, and ``--out`` gets the same figures as JSON.

A second table says where a step's time goes, per worker: the time the training thread waited
for the next batch, the CPU time of the training thread and of the process's other threads (the
stream's planning and prefetch, gloo's), and redis-server's CPU time. On a machine other jobs
share, the CPU figures stay meaningful when the rates do not.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def _train(loader, events: int, warmup: int, redis_cpu=None) -> dict[str, float]:
    """Train one run from ``loader``; returns the global events/s after warm-up (the same on every worker)
    and, per timed step on this worker: the time the training thread waited for the loader, its own CPU,
    the CPU of the process's other threads (prefetch, planning) and redis-server's CPU (``redis_cpu``)."""
    import torch
    import torch.nn.functional as F

    import phalanx as px
    from phalanx.bench.models import digits_cnn

    torch.manual_seed(0)
    net = digits_cnn()
    model, opt = px.wrap(net, torch.optim.Adam(net.parameters(), lr=3e-3))
    px.barrier()
    step, seen, wait = 0, 0, 0.0
    start = thread0 = process0 = server0 = 0.0
    batches = iter(loader)
    while True:
        asked = time.perf_counter()
        try:
            x, y = next(batches)
        except StopIteration:
            break
        if step >= warmup:
            wait += time.perf_counter() - asked
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
        step += 1
        if step == warmup:
            start, seen, wait = time.perf_counter(), 0, 0.0
            thread0, process0 = time.thread_time(), time.process_time()
            server0 = redis_cpu() if redis_cpu else 0.0
        elif step > warmup:
            seen += len(y)
    thread, process = time.thread_time() - thread0, time.process_time() - process0
    server = redis_cpu() - server0 if redis_cpu else 0.0
    elapsed = torch.tensor([time.perf_counter() - start])
    total = torch.tensor([float(seen)])
    comm = px.Comm()
    comm.all_reduce_([total], op="sum")
    comm.all_reduce_([elapsed], op="max")  # the slower worker's clock: the group is done when both are
    timed = max(1, step - warmup) / 1000  # per-step figures in ms
    return {"rate": total.item() / elapsed.item(), "wait_ms": wait / timed, "thread_cpu_ms": thread / timed,
            "other_cpu_ms": (process - thread) / timed, "redis_cpu_ms": server / timed,
            "step_ms": elapsed.item() / timed}


def worker(url: str, events: int, batch_size: int, warmup: int, repeats: int) -> list[dict[str, dict]]:
    """Every repeat: one run from the stream and one from memory; returns this worker's figures per repeat."""
    import redis
    import torch

    import phalanx as px
    from phalanx.bench.models import load_digits_split
    from phalanx.stream import RedisStream, StreamLoader, decode_sample

    px.init()
    train, _ = load_digits_split()
    idx = torch.arange(events) % len(train)  # the producer's images, in its order
    data = torch.utils.data.TensorDataset(train.tensors[0][idx], train.tensors[1][idx])
    server = redis.Redis.from_url(url)

    def redis_cpu() -> float:  # seconds of CPU redis-server used so far (rank 0 reads it for the group)
        info = server.info("cpu")
        return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])

    runs = []
    for r in range(repeats):
        run = {}
        for mode in ("stream", "memory") if r % 2 == 0 else ("memory", "stream"):
            if mode == "stream":
                loader = StreamLoader(RedisStream(url, stream="bench", group=f"repeat{r}", decode=decode_sample,
                                                  create=True), batch_size)
                run[mode] = _train(loader, events, warmup, redis_cpu if px.rank() == 0 else None)
                loader.close()
            else:
                run[mode] = _train(px.shard(data, batch_size, shuffle=False), events, warmup)
        runs.append(run)
    return runs


def _costs(runs: list[list[dict[str, dict]]]) -> dict[str, dict]:
    """Per source: the median over repeats of each per-step figure, per rank (redis-server's once)."""
    med = statistics.median
    out = {}
    for mode in ("stream", "memory"):
        out[mode] = {"step_ms": med(run[mode]["step_ms"] for run in runs[0]),
                     "redis_cpu_ms": med(run[mode]["redis_cpu_ms"] for run in runs[0])}
        for key in ("wait_ms", "thread_cpu_ms", "other_cpu_ms"):
            out[mode][key] = [med(run[mode][key] for run in rank) for rank in runs]
    return out


def _summary(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--events", type=int, default=12000, help="events per run (default 12000)")
    p.add_argument("--batch-size", type=int, default=64, help="events per worker per step (default 64)")
    p.add_argument("--repeats", type=int, default=21,
                   help="stream/memory pairs (default 21: the per-repeat spread is wide on 2 cores, the median is not)")
    p.add_argument("--warmup", type=int, default=10, help="steps left out of each run's timing (default 10)")
    p.add_argument("--out", default=None, help="folder for stream.json")
    a = p.parse_args(argv)
    os.environ["PYTHONPATH"] = os.pathsep.join([HERE, os.environ.get("PYTHONPATH", "")])
    from phalanx.stream.broker import RedisServer
    from phalanx.bench.procs import run_workers

    began = time.monotonic()
    from phalanx.bench.stream_demo import digits
    from phalanx.stream.producer import publish
    with RedisServer() as server:
        # A backlog, published before the workers start: the figure is what the workers consume, not the
        # producer's pace. Every repeat reads the same stream through a consumer group of its own.
        publish(server.url, "bench", data=digits(a.events), count=a.events, rate=0, end=True)
        runs = run_workers("stream:worker", world_size=2, timeout=900, url=server.url, events=a.events,
                           batch_size=a.batch_size, warmup=a.warmup, repeats=a.repeats).results
    rates = [{mode: run[mode]["rate"] for mode in run} for run in runs[0]]
    for r, rate in enumerate(rates, 1):
        print(f"repeat {r}: stream {rate['stream']:,.0f} events/s, memory {rate['memory']:,.0f} samples/s, "
              f"overhead {1 - rate['stream'] / rate['memory']:.1%}")
    stream = _summary([r["stream"] for r in rates])
    memory = _summary([r["memory"] for r in rates])
    overhead = _summary([1 - r["stream"] / r["memory"] for r in rates])
    overhead["pooled"] = 1 - sum(1 / r["memory"] for r in rates) / sum(1 / r["stream"] for r in rates)
    print(f"\n2 workers (gloo, 1 thread each), digits CNN, batch {a.batch_size}/worker, {a.events} events per run, "
          f"{a.repeats} repeats:\n"
          "| source | events/s, median | min-max |\n|---|---:|---:|\n"
          f"| Redis stream (producer at full speed) | {stream['median']:,.0f} | "
          f"{stream['min']:,.0f}-{stream['max']:,.0f} |\n"
          f"| in-memory dataset, same events | {memory['median']:,.0f} | {memory['min']:,.0f}-{memory['max']:,.0f} |\n"
          f"\noverhead of the stream (1 - stream/memory, per repeat): median {overhead['median']:.1%}, "
          f"min-max {overhead['min']:.1%} to {overhead['max']:.1%}; from the total time of all runs "
          f"{overhead['pooled']:.1%}  ({time.monotonic() - began:.0f} s)")
    costs = _costs(runs)
    print("\nwhere a step's time goes (ms per step, median over repeats; rank 0 / rank 1):\n"
          "| source | step | waiting for the loader | training thread CPU | other threads' CPU | redis-server CPU |\n"
          "|---|---:|---:|---:|---:|---:|")
    for mode, c in costs.items():
        print(f"| {mode} | {c['step_ms']:.2f} | {c['wait_ms'][0]:.2f} / {c['wait_ms'][1]:.2f} | "
              f"{c['thread_cpu_ms'][0]:.2f} / {c['thread_cpu_ms'][1]:.2f} | "
              f"{c['other_cpu_ms'][0]:.2f} / {c['other_cpu_ms'][1]:.2f} | {c['redis_cpu_ms']:.2f} |")
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, "stream.json"), "w") as f:
            json.dump({"config": vars(a), "repeats": rates, "stream_events_per_s": stream,
                       "memory_samples_per_s": memory, "overhead": overhead, "ms_per_step": costs,
                       "runs_per_rank": runs}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
