"""Placement: which server holds which variable, or which piece of it.

TensorFlow's round-robin device setter, the default until 0.12, put every weight matrix
on one server and every bias on the other whenever layers alternated weight and bias
with two servers. :class:`GreedyBytes` avoids that.
It sorts the pieces largest first and puts each on the least-loaded server. Tensors
larger than ``max_piece_bytes`` are first cut into contiguous flat pieces. Placing
largest-first this way bounds the load: the fullest server holds at most the mean plus
one piece.

Example:
    >>> tensors = [("w1", (1024, 784), 4), ("b1", (1024,), 4), ("w2", (10, 1024), 4), ("b2", (10,), 4)]
    >>> pieces = GreedyBytes().place(tensors, servers=2)
    >>> round(imbalance(server_bytes(pieces, 2)), 2) <= 1.1
    True
"""
from __future__ import annotations

import heapq
import math
from dataclasses import dataclass
from typing import Sequence

from .. import check
from ..errors import ConfigError, usage

TensorSpec = tuple[str, tuple[int, ...], int]  # (name, shape, bytes per element)


@dataclass(frozen=True)
class Piece:
    """Elements ``[start, stop)`` of variable ``var`` (flattened), held by ``server``."""

    var: str
    shape: tuple[int, ...]  # the variable's own shape
    start: int
    stop: int
    itemsize: int
    server: int

    @property
    def whole(self) -> bool:
        return self.start == 0 and self.stop == math.prod(self.shape)

    @property
    def name(self) -> str:
        """The shard's name on its server: the variable's name, with the range when split."""
        return self.var if self.whole else f"{self.var}[{self.start}:{self.stop}]"

    @property
    def nbytes(self) -> int:
        return (self.stop - self.start) * self.itemsize


def _check_servers(servers: int) -> None:
    check.positive_int("servers", servers, "Start at least one parameter server.")


class RoundRobin:
    """Variable i goes to server i mod S, whole: TensorFlow's old default, kept for comparison."""

    name = "round_robin"

    def place(self, tensors: Sequence[TensorSpec], servers: int) -> list[Piece]:
        _check_servers(servers)
        return [Piece(name, tuple(shape), 0, math.prod(shape), size, i % servers)
                for i, (name, shape, size) in enumerate(tensors)]

    def __repr__(self) -> str:
        return "RoundRobin()"


class GreedyBytes:
    """Largest piece first onto the least-loaded server; large tensors split into pieces.

    Args:
        max_piece_bytes: split tensors larger than this. By default it is total / (16·S),
            but at least 64 KiB. With that default the fullest server holds at most
            about 1/16 more than the mean.
    """

    name = "greedy_bytes"

    def __init__(self, max_piece_bytes: int | None = None) -> None:
        if max_piece_bytes is not None:
            check.positive_int("max_piece_bytes", max_piece_bytes,
                               "Leave it unset (None) to derive it from the model and server count.")
        self.max_piece_bytes = max_piece_bytes

    def place(self, tensors: Sequence[TensorSpec], servers: int) -> list[Piece]:
        _check_servers(servers)
        total = sum(math.prod(shape) * size for _, shape, size in tensors)
        limit = self.max_piece_bytes or max(64 * 1024, math.ceil(total / (16 * servers)))
        cut: list[tuple[str, tuple[int, ...], int, int, int]] = []
        for name, shape, size in tensors:
            numel = math.prod(shape)
            parts = max(1, math.ceil(numel * size / limit)) if servers > 1 else 1
            step = math.ceil(numel / parts) if numel else 0
            bounds = [(a, min(a + step, numel)) for a in range(0, numel, step)] if numel else [(0, 0)]
            cut += [(name, tuple(shape), a, b, size) for a, b in bounds]
        # Largest first; ties keep the model's order so every worker computes the same plan.
        order = sorted(range(len(cut)), key=lambda i: (-(cut[i][3] - cut[i][2]) * cut[i][4], i))
        heap = [(0, s) for s in range(servers)]
        owner: dict[int, int] = {}
        for i in order:
            load, s = heapq.heappop(heap)
            owner[i] = s
            heapq.heappush(heap, (load + (cut[i][3] - cut[i][2]) * cut[i][4], s))
        return [Piece(name, shape, a, b, size, owner[i]) for i, (name, shape, a, b, size) in enumerate(cut)]

    def __repr__(self) -> str:
        return f"GreedyBytes(max_piece_bytes={self.max_piece_bytes})"


POLICIES = {"round_robin": RoundRobin, "greedy_bytes": GreedyBytes}


def policy(spec: "str | RoundRobin | GreedyBytes") -> "RoundRobin | GreedyBytes":
    """A placement policy from its name or the object itself."""
    if isinstance(spec, str):
        key = spec.strip().lower().replace("-", "_")
        if key not in POLICIES:
            raise ConfigError(usage(f"placement={spec!r}", "one of " + ", ".join(POLICIES),
                                    "Pass a name or an object with place(tensors, servers)."))
        return POLICIES[key]()
    if not callable(getattr(spec, "place", None)):
        raise ConfigError(usage(f"placement={spec!r}", "a placement name or an object with place(tensors, servers)",
                                "Use 'greedy_bytes' or 'round_robin'."))
    return spec


def server_bytes(pieces: Sequence[Piece], servers: int) -> list[int]:
    """Bytes held by each server under ``pieces``."""
    load = [0] * servers
    for p in pieces:
        load[p.server] += p.nbytes
    return load


def imbalance(loads: Sequence[float]) -> float:
    """max / mean of per-server loads: 1.0 is perfect balance, S means one server holds everything."""
    mean = sum(loads) / len(loads) if loads else 0.0
    return max(loads) / mean if mean else 1.0


def specs(named: Sequence[tuple[str, "object"]]) -> list[TensorSpec]:
    """``(name, shape, itemsize)`` for each ``(name, tensor)``, the input of ``place``."""
    return [(n, tuple(t.shape), t.element_size()) for n, t in named]  # type: ignore[attr-defined]
