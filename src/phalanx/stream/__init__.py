"""Train from a live event stream, every event exactly once: ``px.stream``.

Example (a redis-server must be running; the loop is the usual one)::

    source = px.stream.RedisStream("redis://localhost:6379/0", stream="events", group="trainer",
                                   decode=px.stream.decode_sample)
    loader = px.stream.StreamLoader(source, batch_size=32, policy=px.stream.Deadline(0.5))
    for x, y in loader:
        ...
    loader.close()

redis-py is imported only when a ``RedisStream`` is made, so ``import phalanx`` does not need it.
"""
from __future__ import annotations

from .codec import decode_sample, decode_samples, encode_sample
from .loader import StreamLoader
from .policy import Deadline, Stop, WaitFull
from .redis_stream import RedisStream
from .source import Event, StreamError, StreamSource

__all__ = ["RedisStream", "StreamLoader", "WaitFull", "Deadline", "Stop", "StreamSource", "Event", "StreamError",
           "encode_sample", "decode_sample", "decode_samples"]
