"""A step's plan: which events each worker trains, decided by the main worker and broadcast as int64s.

A plan names, per rank, a contiguous id range of the stream and how many good
events it holds; several plans travel in one fixed-size tensor (one broadcast for
up to ``ahead`` steps). Ids are ``(milliseconds, sequence)`` pairs packed as two
int64s each.

Example:
    >>> p = Plan(STEP, total=3, position="3-0", offset=3, parts=split(["1-0", "2-0", "3-0"], 2))
    >>> [q.parts for q in unpack_plans(pack_plans([p, p], 2, 1 + 2 * (HEAD + PER_RANK * 2)), 2)]
    [(('1-0', '2-0', 2), ('3-0', '3-0', 1)), (('1-0', '2-0', 2), ('3-0', '3-0', 1))]
"""
from __future__ import annotations

from dataclasses import dataclass, field
from concurrent.futures import Future
from typing import Any, NamedTuple

import torch

from .source import START, format_id, parse_id

WAIT, STEP, END, ERROR = 0, 1, 2, 3
HEAD, PER_RANK = 10, 5


class Fetched(NamedTuple):
    """A step's part on a non-main worker: the ``index``-th of the parts one background fetch brings."""
    parts: Future
    index: int


@dataclass
class Plan:
    """One step, as the main worker decided it: ``parts[rank] = (first_id, last_id, count)``."""
    status: int
    total: int = 0
    final: bool = False
    consumed: int = 0  # entries the step moved past: good, dead-lettered and the end marker
    lag: int = -1
    dead: int = 0
    position: str = START
    offset: int = -1  # entries up to the position after this step, -1 when unknown
    parts: tuple[tuple[str, str, int], ...] = ()
    structure: int = 0  # the fingerprint of the structure every batch has (decoding.fingerprint), 0 if not fixed
    mine: Any = field(default=None, repr=False, compare=False)  # this worker's decoded part, or where it comes

    def pack(self, world_size: int) -> torch.Tensor:
        t = torch.zeros(HEAD + PER_RANK * world_size, dtype=torch.int64)
        t[:6] = torch.tensor([self.status, self.total, int(self.final), self.consumed, self.lag, self.dead])
        t[6:8] = torch.tensor(_ints(self.position))
        t[8], t[9] = self.offset, self.structure
        for r, (first, last, count) in enumerate(self.parts):
            t[HEAD + PER_RANK * r:HEAD + PER_RANK * (r + 1)] = torch.tensor([*_ints(first), *_ints(last), count])
        return t

    @classmethod
    def unpack(cls, t: torch.Tensor, world_size: int) -> "Plan":
        v = t.tolist()
        parts = tuple((_id(*v[i:i + 2]), _id(*v[i + 2:i + 4]), v[i + 4])
                      for i in range(HEAD, HEAD + PER_RANK * world_size, PER_RANK))
        return cls(v[0], v[1], bool(v[2]), v[3], v[4], v[5], _id(v[6], v[7]), v[8], parts, v[9])


def pack_plans(plans: list[Plan], world_size: int, size: int) -> torch.Tensor:
    """Several planned steps in one fixed-size tensor: their count, then each step's plan."""
    t = torch.zeros(size, dtype=torch.int64)
    t[0], at = len(plans), 1
    for plan in plans:
        one = plan.pack(world_size)
        t[at:at + len(one)] = one
        at += len(one)
    return t


def unpack_plans(t: torch.Tensor, world_size: int) -> list[Plan]:
    n, width = int(t[0]), HEAD + PER_RANK * world_size
    return [Plan.unpack(t[1 + k * width:1 + (k + 1) * width], world_size) for k in range(n)]


def split(ids: list[str], world_size: int) -> tuple[tuple[str, str, int], ...]:
    """Contiguous, near-equal parts of a global batch, as ``(first, last, count)`` per rank.

    A rank left without an event (fewer events than workers, only at the end of a
    run) gets the batch's first event as a stand-in with count 0: weight 0, so it
    adds nothing to the gradient but still joins the step's collectives.

    Example:
        >>> split(["1-0", "2-0", "3-0"], 2)
        (('1-0', '2-0', 2), ('3-0', '3-0', 1))
    """
    q, r = divmod(len(ids), world_size)
    parts, start = [], 0
    for rank in range(world_size):
        stop = start + q + (1 if rank < r else 0)
        parts.append((ids[start], ids[stop - 1], stop - start) if stop > start else (ids[0], ids[0], 0))
        start = stop
    return tuple(parts)


def _ints(entry_id: str) -> tuple[int, int]:
    ms, seq = parse_id(entry_id)
    return ms, seq - 2**64 if seq >= 2**63 else seq  # int64 carries the full unsigned sequence


def _id(ms: int, seq: int) -> str:
    return format_id(ms, seq + 2**64 if seq < 0 else seq)
