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
import sys
import time
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

import torch
import torch.distributed as dist

from . import group
from ..framing import from_bytes, to_bytes
from .guard import InFlight, guarded, wait_watched
from .spans import span


@dataclass
class CommStats:
    """Running totals; read them, diff them, never reset them behind a user's back."""

    bytes_sent: int = 0  # payload bytes this worker put into collectives
    calls: int = 0
    seconds: float = 0.0  # wall time blocked in collectives (exposed communication)
    bytes_received: int = 0  # payload bytes received point to point (Comm.send_recv_); collectives do not count

    def snapshot(self) -> "CommStats":
        return CommStats(self.bytes_sent, self.calls, self.seconds, self.bytes_received)


# -- Python objects through collectives ------------------------------------------------------------------------------

def _wire_device() -> torch.device:
    """Where a byte tensor must be for the default group: NCCL moves CUDA tensors only; gloo takes CPU ones."""
    return group.device() if "nccl" in str(dist.get_backend()) else torch.device("cpu")


def _objects(kind: str, obj: Any, root: int, what: str, pg: Any = None) -> Any:
    """The one way objects cross the group: ``torch.save`` bytes in a uint8 tensor, read back weights-only.

    ``kind`` is "all_gather" (every rank's object on every rank), "gather" (on ``root``
    only; None elsewhere) or "broadcast" (``root``'s object on every rank). Nothing
    received is unpickled freely: ``torch.load(weights_only=True)`` builds tensors and
    plain containers only, so tensors and plain values (numbers, strings, lists,
    dicts) travel; received tensors are on the CPU. Guarded: a lost peer raises
    :class:`WorkerLostError`. ``pg``: a process group other than the generation's (ranks are in it).
    """
    g = group.current()
    if g.entering:  # a joiner not yet in its group: nobody to send to
        return [obj] if kind in ("all_gather", "gather") else obj
    world, me = (g.world_size, g.rank) if pg is None else (dist.get_world_size(pg), dist.get_rank(pg))
    pg = g.process_group if pg is None else pg  # the generation's own group, named explicitly
    if world == 1:
        return [obj] if kind in ("all_gather", "gather") else obj
    device = _wire_device()
    sending = kind != "broadcast" or me == root
    blob = torch.frombuffer(bytearray(to_bytes(obj)), dtype=torch.uint8) if sending else \
        torch.empty(0, dtype=torch.uint8)
    size = torch.tensor([blob.numel()], dtype=torch.int64, device=device)
    with guarded(what):
        if kind == "broadcast":
            dist.broadcast(size, group=pg, group_src=root)
            buf = blob.to(device) if me == root else torch.empty(int(size.item()), dtype=torch.uint8, device=device)
            dist.broadcast(buf, group=pg, group_src=root)
            return obj if me == root else from_bytes(buf.cpu().numpy().tobytes(), f"rank {root}'s {what}")
        sizes = [torch.zeros_like(size) for _ in range(world)]
        dist.all_gather(sizes, size, group=pg)
        padded = torch.zeros(int(max(int(s.item()) for s in sizes)), dtype=torch.uint8, device=device)
        padded[:blob.numel()] = blob.to(device)
        if kind == "all_gather":
            out: list[torch.Tensor] | None = [torch.empty_like(padded) for _ in range(world)]
            dist.all_gather(out, padded, group=pg)
        else:
            out = [torch.empty_like(padded) for _ in range(world)] if me == root else None
            dist.gather(padded, out, group=pg, group_dst=root)
    if out is None:
        return None
    return [from_bytes(t[:int(n.item())].cpu().numpy().tobytes(), f"rank {r}'s {what}")
            for r, (t, n) in enumerate(zip(out, sizes, strict=True))]


def all_gather_object(obj: Any, what: str = "an all-gather of objects") -> list[Any]:
    """Every rank's ``obj`` (tensors and plain values), in rank order, on every rank. Collective.

    Example:
        >>> all_gather_object({"step": 3})
        [{'step': 3}]
    """
    return _objects("all_gather", obj, 0, what)


def gather_object(obj: Any, dst: int = 0, what: str = "a gather of objects") -> list[Any] | None:
    """Every rank's ``obj`` on rank ``dst``, in rank order; None on the others. Collective.

    Example:
        >>> gather_object([1, 2])
        [[1, 2]]
    """
    return _objects("gather", obj, dst, what)


def broadcast_object(obj: Any, src: int = 0, what: str = "a broadcast of an object") -> Any:
    """Rank ``src``'s ``obj`` on every rank (the others pass anything, e.g. None). Collective.

    Example:
        >>> broadcast_object("hello")
        'hello'
    """
    return _objects("broadcast", obj, src, what)


def local_shard(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``t``: the local shard of a DTensor (sharing its storage), ``t`` itself otherwise.

    A sharded model's tensors cross a :class:`Comm` as their local shards: over the mesh's
    "replicate" group each rank meets the same shard of the other replica groups.

    Example:
        >>> local_shard(torch.ones(2))
        tensor([1., 1.])
    """
    # A DTensor exists only once FSDP has imported torch.distributed.tensor; importing it here would cost every
    # worker 1.1 s of start-up (python -X importtime), sharded or not.
    dtensor = sys.modules.get("torch.distributed.tensor")
    return t.detach().to_local() if dtensor is not None and isinstance(t, dtensor.DTensor) else t


def _coalesced(tensors: Sequence[torch.Tensor]) -> Iterator[tuple[torch.Tensor, list[torch.Tensor]]]:
    """Group by dtype/device and flatten, so one collective moves many small tensors (DTensors: their shards)."""
    buckets: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for t in map(local_shard, tensors):
        buckets.setdefault((t.dtype, t.device), []).append(t)
    for ts in buckets.values():
        yield torch.cat([t.reshape(-1) for t in ts]), ts


def scatter_back(flat: torch.Tensor, ts: Sequence[torch.Tensor]) -> None:
    """Copy consecutive slices of ``flat`` back into ``ts`` (the inverse of concatenating them).

    A rule that flattens many tensors into one message uses it to unpack the result.

    Example:
        >>> import torch, phalanx as px
        >>> a, b = torch.zeros(2), torch.zeros(1)
        >>> px.scatter_back(torch.tensor([1., 2., 3.]), [a, b]); a, b
        (tensor([1., 2.]), tensor([3.]))
    """
    offset = 0
    for t in ts:
        n = t.numel()
        t.copy_(flat[offset:offset + n].view_as(t))
        offset += n


class Comm:
    """All-reduce, broadcast and all-gather over the generation's group, or over ``process_group``, accounted.

    ``process_group`` (for example a device mesh's "replicate" group, :mod:`phalanx.sharding.layout`)
    makes a strategy run among that group's ranks only: ``rank``, ``world_size`` and every
    rank argument (``src``, ``peer``) are then the group's.

    Example:
        >>> comm = Comm(); x = torch.arange(4.); comm.broadcast_([x]); x.tolist()
        [0.0, 1.0, 2.0, 3.0]
    """

    def __init__(self, process_group: Any = None) -> None:
        self.stats = CommStats()
        self.group = process_group  # None: the generation's group, wherever phalanx.elastic moves it

    @property
    def process_group(self) -> Any:
        """The torch process group the collectives run on now: ``process_group``, or the current generation's."""
        return self.group if self.group is not None else group.current().process_group

    @property
    def world_size(self) -> int:
        """The workers this one exchanges with now: its process group's, or 1 for a joiner that has not entered yet.

        A joiner placed in an elastic group (:meth:`phalanx.group.group.Group.place`) wraps its model
        before its process group exists; it takes rank 0's state when it enters.
        """
        if self.group is not None:
            return dist.get_world_size(self.group)
        g = group.current()
        return 1 if g.entering else g.world_size

    @property
    def rank(self) -> int:
        if self.group is not None:
            return dist.get_rank(self.group)
        g = group.current()
        return 0 if g.entering else g.rank

    @contextlib.contextmanager
    def _timed(self, what: str, nbytes: int) -> Iterator[None]:
        start = time.perf_counter()
        with guarded(what), span(f"phalanx/{what}"):  # the timeline (phalanx.step.profiling)
            yield
        self.stats.seconds += time.perf_counter() - start
        self.stats.bytes_sent += nbytes
        self.stats.calls += 1

    def all_reduce_(self, tensors: Sequence[torch.Tensor], op: str = "mean") -> None:
        """Reduce in place across workers; ``op`` is "mean" or "sum"."""
        if self.world_size == 1:
            return
        for flat, ts in _coalesced(tensors):
            with self._timed("all_reduce", flat.numel() * flat.element_size()):  # gloo has no AVG: sum, then scale
                wait_watched(dist.all_reduce(flat, group=self.process_group, async_op=True), "an all-reduce")
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
                dist.broadcast(flat, group=self.process_group, group_src=src)
            scatter_back(flat, ts)

    def all_gather_state(self, state: Any) -> list[Any]:
        """Every worker's state dict (tensors and plain values), in rank order (see :func:`all_gather_object`)."""
        return _objects("all_gather", state, 0, "an all-gather of state", self.group)

    def record(self, nbytes: int, seconds: float = 0.0) -> None:
        """Account traffic that went through another transport (parameter servers), as one call.

        Example:
            >>> comm = Comm(); comm.record(1024, 0.5); (comm.stats.bytes_sent, comm.stats.calls)
            (1024, 1)
        """
        self.stats.bytes_sent += int(nbytes)
        self.stats.seconds += float(seconds)
        self.stats.calls += 1

    def all_reduce_async(self, tensor: torch.Tensor) -> InFlight:
        """Start summing ``tensor`` across workers in place; returns the collective in flight (:class:`InFlight`:
        its ``wait()`` ends as soon as a peer is known gone).

        The bytes are counted now; the time is not (it overlaps the caller's work, e.g. backward).
        """
        with span("phalanx/bucket"):  # the timeline: the send; the wait is in the exchange's span
            work = dist.all_reduce(tensor, group=self.process_group, async_op=True)
        self.record(tensor.numel() * tensor.element_size())
        return InFlight(work, work.get_future(), "an all-reduce in flight")

    def exchange_with(self, peer: int, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Send ``tensors`` to rank ``peer`` and receive its tensors of the same shapes (point to point).

        Both ranks must call it naming each other, as gossip rules pair workers. Returns the
        peer's tensors; ``tensors`` are left unchanged.

        Example (pair ranks 0-1, 2-3, ...; in a group of one the peer is oneself):
            >>> comm = Comm(); mine = [torch.ones(2)]
            >>> comm.exchange_with(comm.rank ^ 1 if comm.world_size > 1 else 0, mine)
            [tensor([1., 1.])]
        """
        if peer == self.rank or self.world_size == 1:
            return [t.clone() for t in tensors]
        theirs_by_id: dict[int, torch.Tensor] = {}
        for flat, ts in _coalesced(tensors):
            theirs = torch.empty_like(flat)
            with self._timed(f"exchange with rank {peer}", flat.numel() * flat.element_size()):
                to = peer if self.group is None else dist.get_global_rank(self.group, peer)
                pg = self.process_group
                ops = [dist.P2POp(dist.isend, flat, to, pg), dist.P2POp(dist.irecv, theirs, to, pg)]
                for work in dist.batch_isend_irecv(ops):
                    wait_watched(work, f"an exchange with rank {peer}")
            outs = [torch.empty_like(t) for t in ts]
            scatter_back(theirs, outs)
            theirs_by_id.update(zip(map(id, ts), outs))
        return [theirs_by_id[id(t)] for t in tensors]

    def send_recv_(self, sends: Sequence[tuple[int, torch.Tensor]], recvs: Sequence[tuple[int, torch.Tensor]],
                   tag: int = 0) -> None:
        """Point to point: send each ``(rank, tensor)`` of ``sends``, receive into each ``(rank, buffer)`` of ``recvs``
        in place, and wait for all of them.

        Only the ranks named take part (not a collective); each send must meet a receive of the
        same size and ``tag`` on its peer, and a rank names each peer at most once per ``tag`` and
        direction. Ranks are this comm's. Accounted in ``stats.bytes_sent`` and ``stats.bytes_received``.

        Example (in a group of one there is nobody to name):
            >>> Comm().send_recv_([], [])
        """
        if not sends and not recvs:
            return
        out = [t.contiguous() for _, t in sends]  # kept alive until the sends are done
        into = [b if b.is_contiguous() else torch.empty_like(b, memory_format=torch.contiguous_format)
                for _, b in recvs]
        with self._timed("send_recv", sum(t.numel() * t.element_size() for t in out)):
            works = [dist.isend(t, group=self.process_group, group_dst=r, tag=tag)
                     for (r, _), t in zip(sends, out, strict=True)]
            works += [dist.irecv(b, group=self.process_group, group_src=r, tag=tag)
                      for (r, _), b in zip(recvs, into, strict=True)]
            for work in works:
                wait_watched(work, "a point-to-point exchange")
        for (_, b), got in zip(recvs, into, strict=True):
            if got is not b:
                b.copy_(got)
        self.stats.bytes_received += sum(b.numel() * b.element_size() for b in into)

    def barrier(self) -> None:
        """Wait for every worker; a no-op in a group of one."""
        if self.world_size > 1:
            with self._timed("barrier", 0):
                dist.barrier(group=self.process_group)

    def all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Every worker's ``tensor`` (same shape on all), in rank order."""
        if self.world_size == 1:
            return [tensor]
        tensor = local_shard(tensor).contiguous()
        out = [torch.empty_like(tensor) for _ in range(self.world_size)]
        with self._timed("all_gather", tensor.numel() * tensor.element_size()):
            dist.all_gather(out, tensor, group=self.process_group)
        return out


def barrier() -> None:
    """Wait for every worker; a no-op in a group of one (``px.barrier()``).

    Example:
        >>> import phalanx as px
        >>> px.barrier()
    """
    if Comm().world_size > 1:
        with guarded("barrier"):
            dist.barrier(group=group.current().process_group)
