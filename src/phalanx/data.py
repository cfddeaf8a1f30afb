"""Sharded data: each worker reads only its own part of every global batch.

The epoch's permutation is cut into global batches of ``world_size * batch_size``
samples and each global batch is split across workers. So N workers with batch b
see, together, exactly the batches one process sees with batch N·b and the same
seed, which is what makes distributed training checkable against one process.
Every sample of an epoch goes to exactly one worker and every worker takes the
same number of steps: a short last global batch is split as evenly as possible,
and one too small to give each worker a sample joins the batch before it.

Example:
    >>> import torch, phalanx as px
    >>> data = torch.utils.data.TensorDataset(torch.arange(10.))
    >>> loader = px.shard(data, batch_size=4, shuffle=True, seed=0)
    >>> loader.set_epoch(0); sum(len(b[0]) for b in loader)
    10
"""
from __future__ import annotations

from typing import Any, Iterator, Sized

import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from . import group
from .errors import ConfigError, usage
from .prefetch import prefetch


def global_batches(n: int, batch_size: int, world_size: int, *, shuffle: bool, seed: int, epoch: int,
                   drop_last: bool = False) -> list[list[list[int]]]:
    """The epoch's plan: ``plan[step][rank]`` is the list of sample indices."""
    if shuffle:
        gen = torch.Generator().manual_seed(seed + epoch)  # deterministic, different every epoch
        order = torch.randperm(n, generator=gen).tolist()
    else:
        order = list(range(n))
    size = batch_size * world_size
    batches = [order[i:i + size] for i in range(0, n, size)]
    if batches and len(batches[-1]) < size:
        if drop_last:
            batches.pop()
        elif len(batches[-1]) < world_size and len(batches) > 1:
            tail = batches.pop()
            batches[-1] = batches[-1] + tail
    return [_split(b, world_size) for b in batches]


def _split(batch: list[int], world_size: int) -> list[list[int]]:
    """Contiguous, near-equal parts; equal parts when the batch divides."""
    q, r = divmod(len(batch), world_size)
    parts, start = [], 0
    for rank in range(world_size):
        stop = start + q + (1 if rank < r else 0)
        parts.append(batch[start:stop])
        start = stop
    return parts


class ShardSampler(Sampler[list[int]]):
    """A batch sampler yielding this worker's part of each global batch; resumable mid-epoch."""

    def __init__(self, n: int, batch_size: int, *, rank: int, world_size: int, shuffle: bool,
                 seed: int, drop_last: bool) -> None:
        self.n, self.batch_size, self.rank, self.world_size = n, batch_size, rank, world_size
        self.shuffle, self.seed, self.drop_last = shuffle, seed, drop_last
        self.epoch = 0
        self.position = 0  # batches of this epoch already consumed by the training loop

    def set_epoch(self, epoch: int) -> None:
        if epoch != self.epoch:
            self.epoch, self.position = epoch, 0

    def _plan(self) -> list[list[list[int]]]:
        return global_batches(self.n, self.batch_size, self.world_size, shuffle=self.shuffle,
                              seed=self.seed, epoch=self.epoch, drop_last=self.drop_last)

    def __iter__(self) -> Iterator[list[int]]:
        # Starts at ``position`` so a resumed run skips what it already trained on. The
        # loader, not this sampler, advances ``position``: DataLoader workers prefetch.
        plan = self._plan()
        for step in range(self.position, len(plan)):
            yield plan[step][self.rank]

    def __len__(self) -> int:
        return len(self._plan())

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.epoch, self.position, self.seed = int(state["epoch"]), int(state["position"]), int(state["seed"])


class ShardedLoader:
    """A DataLoader over this worker's shard, with ``set_epoch`` and checkpointable position."""

    def __init__(self, dataset: Dataset, sampler: ShardSampler, *, device: torch.device | str | None = None,
                 **loader_kwargs: Any) -> None:
        self.dataset, self.sampler = dataset, sampler
        # -- device prefetch (phalanx.prefetch): batches arrive on ``device``, copied one step ahead
        self.device = torch.device(device) if device is not None else None
        if self.device is not None and self.device.type == "cuda":
            loader_kwargs.setdefault("pin_memory", True)  # pinned in DataLoader's own thread, off the step
        # -- end device prefetch
        # DataLoader draws a seed for its worker processes each time it is iterated. From the global
        # RNG that would shift the training stream (dropout) by one draw per epoch and per resume, so
        # a resumed run would drift from the uninterrupted one; it draws from this generator instead.
        self._own_generator = loader_kwargs.get("generator") is None
        if self._own_generator:
            loader_kwargs["generator"] = torch.Generator()
        self._generator = loader_kwargs["generator"]
        self._loader = DataLoader(dataset, batch_sampler=sampler, **loader_kwargs)

    def set_epoch(self, epoch: int) -> None:
        """Reshuffle for ``epoch``; call it at the top of every epoch, as with DistributedSampler."""
        self.sampler.set_epoch(epoch)

    def __iter__(self) -> Iterator[Any]:
        if self._own_generator:  # deterministic per (seed, epoch, rank), whatever happened before
            s = self.sampler
            self._generator.manual_seed(hash((s.seed, s.epoch, s.rank)) & (2**63 - 1))
        # The prefetcher reads one batch ahead; ``position`` counts only what was handed out.
        for batch in prefetch(self._loader, self.device):
            self.sampler.position += 1
            yield batch
        self.sampler.position = 0  # the epoch is done; iterating again replays it unless set_epoch moves on

    def __len__(self) -> int:
        return len(self.sampler)

    @property
    def batch_size(self) -> int:
        return self.sampler.batch_size

    def state_dict(self) -> dict[str, Any]:
        return self.sampler.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.sampler.load_state_dict(state)


def shard(dataset: Dataset, batch_size: int, *, shuffle: bool = True, seed: int = 0, drop_last: bool = False,
          rank: int | None = None, world_size: int | None = None, device: torch.device | str | None = None,
          **loader_kwargs: Any) -> ShardedLoader:
    """A loader that yields this worker's part of each global batch of ``world_size * batch_size``.

    Extra keyword arguments (``num_workers``, ``pin_memory``, ``collate_fn``...) go to DataLoader.
    ``device`` (e.g. ``px.device()``): batches arrive on it; on a GPU the next batch is copied from
    pinned memory on a side stream while the current step computes (see :mod:`phalanx.prefetch`).

    Example:
        >>> import torch, phalanx as px
        >>> ds = torch.utils.data.TensorDataset(torch.randn(8, 3), torch.arange(8))
        >>> len(px.shard(ds, batch_size=2, rank=0, world_size=2))
        2
    """
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ConfigError(usage(f"batch_size={batch_size!r}", "an integer >= 1 (samples per worker per step)",
                                "Pass e.g. batch_size=64."))
    if not isinstance(dataset, Sized):
        raise ConfigError(usage(f"a {type(dataset).__name__} without len()", "a map-style dataset with __len__",
                                "Wrap tensors in torch.utils.data.TensorDataset, or stream with your own loader."))
    world = group.world_size() if world_size is None else world_size
    me = group.rank() if rank is None else rank
    n = len(dataset)
    if n < world:
        raise ConfigError(usage(f"a dataset of {n} samples for {world} workers",
                                f"at least one sample per worker ({world})", "Use fewer workers or more data."))
    if drop_last and n < world * batch_size:
        raise ConfigError(usage(f"drop_last=True with {n} samples and {world} workers x batch {batch_size}",
                                f"at least {world * batch_size} samples for one full step",
                                "Lower batch_size or set drop_last=False."))
    sampler = ShardSampler(n, batch_size, rank=me, world_size=world, shuffle=shuffle, seed=seed, drop_last=drop_last)
    return ShardedLoader(dataset, sampler, device=device, **loader_kwargs)
