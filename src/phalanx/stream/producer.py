"""A producer for tests, benchmarks and the demo: publish labelled samples to a stream at a set rate.

Run it as a process of its own::

    python -m phalanx.stream.producer unix:///tmp/redis.sock events --count 3000 --rate 1000

``--rate 0`` publishes as fast as Redis takes pipelined XADDs. ``--end`` appends the
end-of-stream marker, ``--pause-at N --pause-s S`` pauses once after N events, and
``--bad-every K`` makes every K-th event undecodable and ``--odd-every K`` every K-th a
well-formed sample of another shape (to exercise dead letters).
"""
from __future__ import annotations

import argparse
import sys
import time
from typing import Iterable, Iterator, Sequence

import torch

from .codec import encode_sample
from .source import END_FIELD


def samples(count: int, seed: int = 0) -> Iterator[tuple[torch.Tensor, int]]:
    """``count`` samples of a small separable problem: 8 features, 3 classes."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(min(count, 4096), 8, generator=gen)
    y = (x[:, :3].argmax(1))
    for i in range(count):
        yield x[i % len(x)], int(y[i % len(y)])


def end_of_stream() -> dict[bytes, bytes]:
    """The fields of the marker event that ends a training run."""
    return {END_FIELD: b"1"}


def publish(url: str, stream: str, *, data: Iterable[tuple[torch.Tensor, int]] | None = None, count: int = 1000,
            rate: float = 0.0, end: bool = True, pause_at: int | None = None, pause_s: float = 0.0, bad_every: int = 0,
            odd_every: int = 0, seed: int = 0) -> int:
    """Publish ``count`` events of ``data`` (default :func:`samples`), plus the marker with ``end``; returns how many.

    The demo's digits come from :mod:`phalanx.bench.stream_demo`, which passes them as ``data``.
    """
    import redis
    r = redis.Redis.from_url(url, socket_timeout=10)
    start, sent, chunk = time.monotonic(), 0, 64
    source = iter(samples(count, seed) if data is None else data)
    paused = False
    while sent < count:
        if pause_at is not None and not paused and sent >= pause_at:
            time.sleep(pause_s)
            start, paused = time.monotonic() - sent / rate if rate else time.monotonic(), True
        due = count - sent if rate <= 0 else min(count, int((time.monotonic() - start) * rate) + 1) - sent
        if pause_at is not None and not paused:
            due = min(due, pause_at - sent)
        if due <= 0:
            time.sleep(0.002)
            continue
        pipe = r.pipeline(transaction=False)
        for _ in range(min(due, chunk)):
            x, y = next(source)
            fields = encode_sample(x[:3] if odd_every and (sent + 1) % odd_every == 0 else x, y, index=sent)
            if bad_every and (sent + 1) % bad_every == 0:
                fields = {b"x": b"not a tensor", b"i": str(sent).encode()}
            pipe.xadd(stream, fields)
            sent += 1
        pipe.execute()
    if end:
        r.xadd(stream, end_of_stream())
    return sent


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m phalanx.stream.producer", description=__doc__.split("\n")[0])
    p.add_argument("url")
    p.add_argument("stream")
    p.add_argument("--count", type=int, default=1000)
    p.add_argument("--rate", type=float, default=0.0, help="events per second; 0 = as fast as possible")
    p.add_argument("--end", action="store_true", help="append the end-of-stream marker")
    p.add_argument("--pause-at", type=int, default=None)
    p.add_argument("--pause-s", type=float, default=0.0)
    p.add_argument("--bad-every", type=int, default=0)
    p.add_argument("--odd-every", type=int, default=0)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    publish(a.url, a.stream, count=a.count, rate=a.rate, end=a.end, pause_at=a.pause_at,
            pause_s=a.pause_s, bad_every=a.bad_every, odd_every=a.odd_every, seed=a.seed)
    return 0


if __name__ == "__main__":
    sys.exit(main())
