"""Events that carry one labelled sample: a float32 tensor and an integer class.

The bytes are the tensor's raw float32 values, little-endian, plus its shape, so
decoding never unpickles anything a producer sent.

Example:
    >>> import torch
    >>> from phalanx.stream.codec import encode_sample, decode_sample
    >>> x, y = decode_sample(encode_sample(torch.arange(4.).reshape(2, 2), 3, index=7))
    >>> x.tolist(), int(y)
    ([[0.0, 1.0], [2.0, 3.0]], 3)
"""
from __future__ import annotations

import math
from operator import itemgetter

import numpy as np
import torch

from ..errors import ConfigError, usage


def encode_sample(x: torch.Tensor, y: int, *, index: int | None = None) -> dict[bytes, bytes]:
    """The fields of one event (``index`` is the producer's own count, kept for bookkeeping)."""
    fields = {b"x": np.ascontiguousarray(x.detach().cpu().numpy(), dtype="<f4").tobytes(),
              b"shape": ",".join(str(d) for d in x.shape).encode(), b"y": str(int(y)).encode()}
    if index is not None:
        fields[b"i"] = str(index).encode()
    return fields


def decode_sample(fields: dict[bytes, bytes]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x, y)`` from :func:`encode_sample`'s fields; raises ConfigError on anything else."""
    try:
        shape = tuple(int(d) for d in fields[b"shape"].split(b",") if d)
        x = torch.from_numpy(np.frombuffer(fields[b"x"], dtype="<f4").copy()).reshape(shape)
        y = torch.tensor(int(fields[b"y"]))
    except (KeyError, ValueError, RuntimeError) as err:
        raise ConfigError(usage(f"an event with fields {sorted(k.decode(errors='replace') for k in fields)} "
                                f"({type(err).__name__}: {err})", "fields x (float32 bytes), shape and y",
                                "Publish events with encode_sample().")) from None
    return x, y


def decode_samples(fields: list[dict[bytes, bytes]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Many events of :func:`encode_sample` at once, stacked: ``(x[n, ...], y[n])``, the same as decoding
    each with :func:`decode_sample` and collating, with one buffer read instead of n.

    Example:
        >>> x, y = decode_samples([encode_sample(torch.ones(2), 1), encode_sample(torch.zeros(2), 0)])
        >>> x.tolist(), y.tolist()
        ([[1.0, 1.0], [0.0, 0.0]], [1, 0])
    """
    if not fields:
        raise ConfigError(usage("no events", "at least one event", "Pass the events of a batch."))
    # C-level maps over the whole part, no Python loop per event: this runs for every event trained
    try:
        shapes = set(map(_SHAPE, fields))
        xs = list(map(_X, fields))
        y = torch.tensor(list(map(int, map(_Y, fields))))
    except (KeyError, ValueError, TypeError) as err:
        raise ConfigError(usage(f"an event without fields x, shape and an integer y ({type(err).__name__}: {err})",
                                "fields x (float32 bytes), shape and y",
                                "Publish events with encode_sample().")) from None
    try:
        shape = tuple(int(d) for d in next(iter(shapes)).split(b",") if d)
    except ValueError as err:
        raise ConfigError(usage(f"an event with shape {next(iter(shapes))!r} ({err})", "a shape such as b'1,8,8'",
                                "Publish events with encode_sample().")) from None
    if len(shapes) != 1 or set(map(len, xs)) != {4 * math.prod(shape)}:
        raise ConfigError(usage("events of different shapes or sizes", f"every event shaped {shape}",
                                "Decode them one by one with decode_sample()."))
    x = torch.from_numpy(np.frombuffer(b"".join(xs), dtype="<f4").copy())
    return x.reshape(len(fields), *shape), y


_X, _Y, _SHAPE = itemgetter(b"x"), itemgetter(b"y"), itemgetter(b"shape")
decode_sample.batch = decode_samples  # type: ignore[attr-defined]  # the stream loader's fast path for a part
