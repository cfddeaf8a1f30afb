"""Device prefetch: the next batch travels to the GPU while the current step computes.

A GPU step that starts by copying its batch from host memory waits for that copy:
the copy and the kernels share the default stream. :func:`prefetch` takes the next
batch from the loader as soon as the current one is handed out and copies it from
pinned memory on a side CUDA stream, so the copy overlaps the step's compute; the
consumer's stream waits for the copy only when it uses the batch.

On a CPU device it is a no-op: the loader's own iterator is returned, unchanged.

Example:
    >>> import torch
    >>> from phalanx.data.prefetch import prefetch
    >>> batches = [(torch.ones(2), torch.zeros(2))]
    >>> [x.device.type for x, _ in prefetch(batches, "cpu")]
    ['cpu']

``px.shard(..., device=px.device())`` and the Trainer use it; any other loader can
be wrapped with :class:`DevicePrefetcher`. Batches are tensors or (nested) tuples,
lists and dicts of tensors; other values pass through as they are.
"""
from __future__ import annotations

from typing import Any, Iterable, Iterator

import torch


def to_device(batch: Any, device: torch.device, *, non_blocking: bool = False) -> Any:
    """``batch`` with every tensor moved to ``device`` (tuples, lists and dicts are rebuilt)."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=non_blocking)
    if isinstance(batch, dict):
        return type(batch)((k, to_device(v, device, non_blocking=non_blocking)) for k, v in batch.items())
    if isinstance(batch, (list, tuple)):
        moved = [to_device(v, device, non_blocking=non_blocking) for v in batch]
        return type(batch)(*moved) if hasattr(batch, "_fields") else type(batch)(moved)  # namedtuples too
    return batch


def _pinned(batch: Any) -> Any:
    """Host tensors in page-locked memory, which an asynchronous copy needs (pinned ones are kept)."""
    if isinstance(batch, torch.Tensor):
        return batch if batch.device.type != "cpu" or batch.is_pinned() else batch.pin_memory()
    if isinstance(batch, dict):
        return type(batch)((k, _pinned(v)) for k, v in batch.items())
    if isinstance(batch, (list, tuple)):
        moved = [_pinned(v) for v in batch]
        return type(batch)(*moved) if hasattr(batch, "_fields") else type(batch)(moved)
    return batch


def _tensors(batch: Any) -> Iterator[torch.Tensor]:
    if isinstance(batch, torch.Tensor):
        yield batch
    elif isinstance(batch, dict):
        for v in batch.values():
            yield from _tensors(v)
    elif isinstance(batch, (list, tuple)):
        for v in batch:
            yield from _tensors(v)


def prefetch(batches: Iterable[Any], device: torch.device | str | None) -> Iterator[Any]:
    """Iterate ``batches`` on ``device``, one batch ahead on a side stream (CUDA only).

    ``device`` None or a CPU device: ``iter(batches)`` itself, nothing added.
    The order and contents of the batches are those of ``batches``.
    """
    dev = torch.device(device) if device is not None else None
    if dev is None or dev.type != "cuda":
        return iter(batches)
    return _cuda_prefetch(batches, dev)


def _cuda_prefetch(batches: Iterable[Any], device: torch.device) -> Iterator[Any]:
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    side = torch.cuda.Stream(device)
    source = iter(batches)

    def load() -> tuple[bool, Any]:
        try:
            host = _pinned(next(source))
        except StopIteration:
            return False, None
        # Dropping ``host`` after this is safe: torch's pinned-memory allocator keeps a
        # block until the asynchronous copy that reads it has finished.
        with torch.cuda.stream(side):
            return True, to_device(host, device, non_blocking=True)

    more, ready = load()
    while more:
        torch.cuda.current_stream(device).wait_stream(side)
        batch = ready
        for t in _tensors(batch):
            if t.device.type == "cuda":
                # Allocated on the side stream, used on the consumer's: tell the caching
                # allocator, or it may hand this memory out again while a kernel still reads it.
                t.record_stream(torch.cuda.current_stream(device))
        more, ready = load()  # the next copy starts now, overlapping this step
        yield batch


class DevicePrefetcher:
    """Wrap any loader so that it yields batches already on ``device``, prefetched on CUDA.

    ``len()``, ``set_epoch()``, ``state_dict()`` and ``load_state_dict()`` pass through to
    the wrapped loader. On a CUDA device the wrapped loader runs one batch ahead of the
    consumer, so its own position counts one batch more than the loop has seen;
    ``px.shard(..., device=...)`` keeps the exact position for checkpoints.

    Example:
        >>> import torch
        >>> loader = DevicePrefetcher([torch.arange(3)], "cpu")
        >>> next(iter(loader)).tolist(), len(loader)
        ([0, 1, 2], 1)
    """

    def __init__(self, loader: Iterable[Any], device: torch.device | str | None) -> None:
        self.loader, self.device = loader, torch.device(device) if device is not None else None

    def __iter__(self) -> Iterator[Any]:
        return prefetch(self.loader, self.device)

    def __len__(self) -> int:
        return len(self.loader)  # type: ignore[arg-type]

    def __getattr__(self, name: str) -> Any:
        if name == "loader":  # not yet set (unpickling): avoid recursing
            raise AttributeError(name)
        return getattr(self.loader, name)


__all__ = ["DevicePrefetcher", "prefetch", "to_device"]
