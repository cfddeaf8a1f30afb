"""A large state moved between ranks as raw tensor bytes, in bounded memory: what a joiner receives.

A model and its optimizer (gigabytes) never become one pickled blob: the layout crosses
weights-only, then the tensors' bytes in chunks of at most :data:`CHUNK_BYTES` straight into
preallocated storage, so a receiver grows by its state plus one chunk and a sender by one chunk.

Example:
    >>> import torch
    >>> broadcast_state({"w": torch.ones(2), "step": 3})
    {'w': tensor([1., 1.]), 'step': 3}
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Any, Iterator, Sequence

import torch
import torch.distributed as dist

from . import group
from .collectives import _objects, _wire_device, local_shard
from .guard import guarded

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
