"""Streaming throughput: 2 workers train the digits CNN from a Redis stream vs from memory.

    python benchmarks/stream.py [--events 6000] [--batch-size 64] [--repeats 2]

A real redis-server starts on a unix socket in a temporary directory. For each repeat a
producer publishes ``--events`` digits images at full speed (pipelined XADD) while two
workers consume and train, and then the same two workers train on an in-memory
dataset of the same images with the same batches (``px.shard``). Rates are global
events (samples) per second with the first ``--warmup`` steps left out; the overhead
is 1 - stream/memory on the medians.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def worker(mode: str, url: str, group: str, events: int, batch_size: int, warmup: int) -> float:
    """One worker's loop; returns the global events/s after warm-up (rank 0's measurement)."""
    import torch
    import torch.nn.functional as F

    import phalanx as px
    from phalanx.models import digits_cnn, load_digits_split
    from phalanx.stream import RedisStream, StreamLoader, decode_sample

    px.init()
    torch.manual_seed(0)
    model = digits_cnn()
    model, opt = px.wrap(model, torch.optim.Adam(model.parameters(), lr=3e-3))
    if mode == "stream":
        loader = StreamLoader(RedisStream(url, stream="bench", group=group, decode=decode_sample, create=True),
                              batch_size)
    else:
        train, _ = load_digits_split()
        idx = torch.arange(events) % len(train)
        data = torch.utils.data.TensorDataset(train.tensors[0][idx], train.tensors[1][idx])
        loader = px.shard(data, batch_size, shuffle=False)
    step, start, seen = 0, 0.0, 0
    for x, y in loader:
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
        step += 1
        if step == warmup:
            start, seen = time.perf_counter(), 0
        elif step > warmup:
            seen += len(y)
    elapsed = time.perf_counter() - start
    total = torch.tensor([float(seen)])
    px.Comm().all_reduce_([total], op="sum")
    return total.item() / elapsed


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--events", type=int, default=6000)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--warmup", type=int, default=5)
    a = p.parse_args(argv)
    sys.path.insert(0, HERE)
    os.environ["PYTHONPATH"] = os.pathsep.join([HERE, os.environ.get("PYTHONPATH", "")])
    from phalanx.stream.broker import RedisServer
    from phalanx.testing import run_workers

    rates: dict[str, list[float]] = {"stream": [], "memory": []}
    with RedisServer() as server:
        for r in range(a.repeats):
            producer = subprocess.Popen([sys.executable, "-m", "phalanx.stream.producer", server.url, "bench",
                                         "--data", "digits", "--count", str(a.events), "--rate", "0", "--end"])
            common = dict(url=server.url, events=a.events, batch_size=a.batch_size, warmup=a.warmup)
            rates["stream"].append(run_workers("stream:worker", world_size=2, timeout=600, mode="stream",
                                               group=f"g{r}", **common).results[0])
            producer.wait()
            import redis
            redis.Redis.from_url(server.url).delete("bench")  # the next repeat streams afresh
            rates["memory"].append(run_workers("stream:worker", world_size=2, timeout=600, mode="memory",
                                               group="-", **common).results[0])
            print(f"repeat {r + 1}: stream {rates['stream'][-1]:,.0f} events/s, "
                  f"memory {rates['memory'][-1]:,.0f} samples/s", flush=True)
    stream, memory = statistics.median(rates["stream"]), statistics.median(rates["memory"])
    print(f"\n2 workers, digits CNN, batch {a.batch_size}/worker, {a.events} events, median of {a.repeats}:\n"
          f"| source | events/s |\n|---|---:|\n| Redis stream (producer at full speed) | {stream:,.0f} |\n"
          f"| in-memory dataset, same events | {memory:,.0f} |\n\noverhead of the stream: {1 - stream / memory:.1%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
