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
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

import torch
import torch.distributed as dist

from . import group, liveness
from ..errors import StoreLostError, WorkerLostError
from ..framing import from_bytes, to_bytes
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


# -- the guard: a failed collective or store wait becomes a typed WorkerLostError -------------------------------------
# It lives here, beside the collectives it guards, so that liveness.py stays a leaf that knows no group.

def lost_ranks(timeout_s: float = liveness.STALE_AFTER_S) -> list[int] | None:
    """After a failed collective: the ranks that are no longer running (None: the store does not answer).

    Never names a rank whose heartbeat still advances. Blocks at most about ``timeout_s``.
    """
    g = group.current()
    if g.probe is None:
        return None
    seen = liveness.survey(g.probe, g.world_size, timeout_s, me=g.rank)
    return None if seen is None else seen.lost


@contextlib.contextmanager
def guarded(what: str) -> Iterator[None]:
    """Turn a failure inside a collective or a store wait into one :class:`WorkerLostError` naming the lost ranks.

    Whatever torch raises there (a gloo socket error, NCCL's ``DistBackendError``, a store's
    ``DistStoreError`` or timeout) is a failure of the group, so it is re-raised as that one
    type with ``lost_ranks`` read from the heartbeats; :class:`StoreLostError` when the store
    itself no longer answers. Errors of other types (a bad argument) pass through as they are.

    Example:
        >>> with guarded("nothing"):
        ...     pass
    """
    try:
        yield
    except RuntimeError as err:  # torch's distributed errors (DistBackendError, DistStoreError...) derive from it
        if isinstance(err, WorkerLostError):
            raise
        g = group.current()
        me = g.rank
        seen = None if g.probe is None else liveness.survey(g.probe, g.world_size, liveness.STALE_AFTER_S, me=me)
        lost = [] if seen is None else liveness.culprits(seen, me)  # the ranks the message blames
        g.losses = lost
        kind = StoreLostError if seen is None and g.probe is not None else WorkerLostError
        raise kind(
            f"rank {me} lost contact with {liveness.describe(seen, me)} during {what} "
            f"(timeout {g.timeout_s:.0f}s): {str(err).splitlines()[0][:200] if str(err) else type(err).__name__}. "
            "See that rank's own log for its error. If it was only slow, raise the bound with "
            "PHALANX_TIMEOUT or px.init(timeout=...).", lost_ranks=lost,
        ) from err


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


# -- a state dict streamed as raw tensor bytes -----------------------------------------------------------------------

CHUNK_BYTES = 16 << 20  # one broadcast moves at most this: the memory a chunk of small tensors costs in flight


def broadcast_state(obj: Any, src: int = 0, what: str = "a broadcast of a state",
                    chunk_bytes: int = CHUNK_BYTES, pg: Any = None) -> Any:
    """Rank ``src``'s ``obj`` (tensors in plain containers) on every rank, its tensors streamed as raw bytes.

    A large state (a model and its optimizer: gigabytes) never becomes one pickled blob: its
    skeleton (containers, plain values, and each tensor's dtype and shape as a storage-free
    ``meta`` tensor) crosses as :func:`broadcast_object` does, weights-only, and the receivers
    allocate every tensor from it. The tensors' bytes then follow as raw broadcasts of at most
    ``chunk_bytes``: a large tensor straight into its preallocated storage, consecutive small
    ones packed into one chunk. A receiver's memory grows by the state plus one chunk; the
    sender's by one chunk; nothing received is unpickled beyond the weights-only skeleton.
    Received tensors are on the CPU and do not share storage with each other. Collective.

    Example:
        >>> broadcast_state({"w": torch.ones(2), "step": 3})
        {'w': tensor([1., 1.]), 'step': 3}
    """
    g = group.current()
    if g.entering:  # a joiner not yet in its group: nobody to send to
        return obj
    world, me = (g.world_size, g.rank) if pg is None else (dist.get_world_size(pg), dist.get_rank(pg))
    if world == 1:
        return obj
    if chunk_bytes < 1:
        raise ValueError(f"chunk_bytes={chunk_bytes}; expected a positive number of bytes")
    pg = g.process_group if pg is None else pg
    sending = me == src
    tensors: list[torch.Tensor] = []
    skeleton = _skeleton(obj, tensors) if sending else None
    skeleton = _objects("broadcast", skeleton, src, f"{what} (its layout)", pg)
    if not sending:
        obj = _allocated(skeleton, tensors)
    device = _wire_device()
    flat = [_bytes_of(t) for t in tensors]
    chunks = list(_chunks([f.numel() for f in flat], chunk_bytes))
    packed = max((size for pieces, size in chunks if len(pieces) > 1), default=0)
    staging = torch.empty(packed, dtype=torch.uint8, device=device)  # every packed chunk's: the one in flight
    with guarded(what):
        for pieces, size in chunks:
            if len(pieces) == 1:  # a whole chunk of one tensor: straight from / into its storage
                i, a, b = pieces[0]
                view = flat[i][a:b]
                buf = view if device.type == "cpu" else view.to(device)
                dist.broadcast(buf, group=pg, group_src=src)
                if not sending and buf is not view:
                    view.copy_(buf)
                continue
            buf = staging[:size]  # one buffer for all: a chunk in flight, whatever the allocator keeps
            if sending:
                torch.cat([flat[i][a:b] for i, a, b in pieces], out=buf)
            dist.broadcast(buf, group=pg, group_src=src)
            if not sending:
                offset = 0
                for i, a, b in pieces:
                    flat[i][a:b].copy_(buf[offset:offset + b - a])
                    offset += b - a
    return obj


def _skeleton(obj: Any, tensors: list[torch.Tensor]) -> Any:
    """``obj`` with each tensor replaced by a storage-free ``meta`` tensor of its dtype and shape, in walk order."""
    if isinstance(obj, torch.Tensor):
        t = local_shard(obj).detach()
        tensors.append(t if t.is_contiguous() else t.contiguous())
        return torch.empty(t.shape, dtype=t.dtype, device="meta")
    if isinstance(obj, dict):
        return _same_kind(obj, ((k, _skeleton(v, tensors)) for k, v in obj.items()))
    if isinstance(obj, (list, tuple)):
        items = [_skeleton(v, tensors) for v in obj]
        return items if isinstance(obj, list) else tuple(items)
    return obj


def _allocated(skeleton: Any, tensors: list[torch.Tensor]) -> Any:
    """The skeleton with each ``meta`` tensor replaced by an uninitialised CPU tensor, appended to ``tensors``."""
    if isinstance(skeleton, torch.Tensor):
        if not skeleton.is_meta:  # a skeleton holds nothing else; refuse rather than guess
            raise ValueError("a state's layout holds a tensor with storage; expected dtype and shape only")
        t = torch.empty(skeleton.shape, dtype=skeleton.dtype)
        tensors.append(t)
        return t
    if isinstance(skeleton, dict):
        return _same_kind(skeleton, ((k, _allocated(v, tensors)) for k, v in skeleton.items()))
    if isinstance(skeleton, (list, tuple)):
        items = [_allocated(v, tensors) for v in skeleton]
        return items if isinstance(skeleton, list) else tuple(items)
    return skeleton


def _same_kind(d: dict, items: Iterator[tuple[Any, Any]]) -> dict:
    """A dict of ``items``: an OrderedDict (a state_dict's) stays one, as weights-only loading keeps it."""
    return OrderedDict(items) if isinstance(d, OrderedDict) else dict(items)


def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's storage as a flat uint8 view (no copy)."""
    return t.reshape(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8)


def _chunks(sizes: Sequence[int], chunk_bytes: int) -> Iterator[tuple[list[tuple[int, int, int]], int]]:
    """Tensors of ``sizes`` bytes cut into chunks of at most ``chunk_bytes``: each a list of (tensor, start, end)
    and its size. A tensor larger than a chunk crosses alone in slices (straight from and into its storage);
    smaller ones are packed whole, several to a chunk, so only a packed chunk needs a buffer."""
    pieces: list[tuple[int, int, int]] = []
    size = 0
    for i, n in enumerate(sizes):
        if pieces and size + n > chunk_bytes:  # it does not fit beside the others: they go first
            yield pieces, size
            pieces, size = [], 0
        if n > chunk_bytes:
            yield from (([(i, a, min(n, a + chunk_bytes))], min(n, a + chunk_bytes) - a)
                        for a in range(0, n, chunk_bytes))
        elif n:
            pieces.append((i, 0, n))
            size += n
    if pieces:
        yield pieces, size


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
            with self._timed("all_reduce", flat.numel() * flat.element_size()):
                dist.all_reduce(flat, group=self.process_group)  # gloo has no AVG, so sum then scale
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

    def all_reduce_async(self, tensor: torch.Tensor) -> torch.futures.Future:
        """Start summing ``tensor`` across workers in place; returns the collective's future.

        The bytes are counted now; the time is not (it overlaps the caller's work, e.g. backward).
        """
        with span("phalanx/bucket"):  # the timeline: the send; the wait is in the exchange's span
            future = dist.all_reduce(tensor, group=self.process_group, async_op=True).get_future()
        self.record(tensor.numel() * tensor.element_size())
        return future

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
                    work.wait()
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
                work.wait()
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
