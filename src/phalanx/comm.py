"""Collectives over the worker group, with byte and time accounting.

Every strategy talks through a :class:`Comm`, so bytes sent per step and the
time spent blocked in communication are measured in one place. In a group of
one every collective is a no-op that costs nothing and sends nothing.

Example:
    >>> import torch, phalanx as px
    >>> comm = px.Comm()
    >>> t = torch.ones(3); comm.all_reduce_([t]); t
    tensor([1., 1., 1.])
"""
from __future__ import annotations

import contextlib
import io
import time
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

import torch
import torch.distributed as dist

from . import group
from .liveness import guarded, lost_ranks  # noqa: F401  (moved; re-exported for existing imports)


@dataclass
class CommStats:
    """Running totals; read them, diff them, never reset them behind a user's back."""

    bytes_sent: int = 0  # payload bytes this worker put into collectives
    calls: int = 0
    seconds: float = 0.0  # wall time blocked in collectives (exposed communication)

    def snapshot(self) -> "CommStats":
        return CommStats(self.bytes_sent, self.calls, self.seconds)


def _coalesced(tensors: Sequence[torch.Tensor]) -> Iterator[tuple[torch.Tensor, list[torch.Tensor]]]:
    """Group by dtype/device and flatten, so one collective moves many small tensors."""
    buckets: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for t in tensors:
        buckets.setdefault((t.dtype, t.device), []).append(t)
    for ts in buckets.values():
        yield torch.cat([t.reshape(-1) for t in ts]), ts


def scatter_back(flat: torch.Tensor, ts: Sequence[torch.Tensor]) -> None:
    """Copy consecutive slices of ``flat`` back into ``ts`` (the inverse of concatenating them)."""
    offset = 0
    for t in ts:
        n = t.numel()
        t.copy_(flat[offset:offset + n].view_as(t))
        offset += n


class Comm:
    """All-reduce, broadcast and all-gather over the default group, accounted.

    Example:
        >>> comm = Comm(); x = torch.arange(4.); comm.broadcast_([x]); x.tolist()
        [0.0, 1.0, 2.0, 3.0]
    """

    def __init__(self) -> None:
        self.stats = CommStats()

    @property
    def world_size(self) -> int:
        return group.world_size()

    @property
    def rank(self) -> int:
        return group.rank()

    @contextlib.contextmanager
    def _timed(self, what: str, nbytes: int) -> Iterator[None]:
        start = time.perf_counter()
        with guarded(what):
            yield
        self.stats.seconds += time.perf_counter() - start
        self.stats.bytes_sent += nbytes
        self.stats.calls += 1

    def all_reduce_(self, tensors: Sequence[torch.Tensor], op: str = "mean") -> None:
        """Reduce in place across workers; ``op`` is "mean" or "sum"."""
        if self.world_size == 1:
            return
        for flat, ts in _coalesced(tensors):
            with self._timed("all_reduce", flat.numel() * flat.element_size()):
                dist.all_reduce(flat)  # gloo has no AVG, so sum then scale
            if op == "mean":
                flat.div_(self.world_size)
            scatter_back(flat, ts)

    def broadcast_(self, tensors: Sequence[torch.Tensor], src: int = 0) -> None:
        """Overwrite ``tensors`` on every worker with rank ``src``'s values."""
        if self.world_size == 1:
            return
        for flat, ts in _coalesced(tensors):
            sent = flat.numel() * flat.element_size() if self.rank == src else 0
            with self._timed("broadcast", sent):
                dist.broadcast(flat, src)
            scatter_back(flat, ts)

    def all_gather_state(self, state: Any) -> list[Any]:
        """Every worker's state dict (tensors and plain values), in rank order.

        Unlike ``dist.all_gather_object`` nothing is unpickled freely: each state travels as
        ``torch.save`` bytes and is read back with ``weights_only=True``, which only builds
        tensors and plain containers.
        """
        if self.world_size == 1:
            return [state]
        buf = io.BytesIO()
        torch.save(state, buf)
        mine = torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)
        sizes = self.all_gather(torch.tensor([mine.numel()], dtype=torch.int64))
        longest = int(max(s.item() for s in sizes))
        padded = torch.zeros(longest, dtype=torch.uint8)
        padded[:mine.numel()] = mine
        return [torch.load(io.BytesIO(blob[:int(n.item())].numpy().tobytes()), weights_only=True)
                for blob, n in zip(self.all_gather(padded), sizes, strict=True)]

    def all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Every worker's ``tensor`` (same shape on all), in rank order."""
        if self.world_size == 1:
            return [tensor]
        out = [torch.empty_like(tensor) for _ in range(self.world_size)]
        with self._timed("all_gather", tensor.numel() * tensor.element_size()):
            dist.all_gather(out, tensor.contiguous())
        return out
