"""The epoch's sampling plan: which samples of the epoch's order each worker takes at each step.

The epoch's permutation is cut into global batches of ``world_size * batch_size``
samples and each global batch is split across workers. So N workers with batch b
see, together, exactly the batches one process sees with batch N·b and the same
seed, which is what makes distributed training checkable against one process.
Every sample of an epoch goes to exactly one worker and every worker takes the
same number of steps, as many as one process with batch N·b: a short last global
batch is split as evenly as possible (a part may be empty). The loader that reads
the plan is :mod:`phalanx.data.loader`; the shares that split it by the workers' speeds
come from :mod:`phalanx.data.balance`.
"""
from __future__ import annotations

import math
from typing import Any, Iterator, Sequence

import torch
from torch.utils.data import Sampler

from ..errors import ConfigError, usage


def epoch_order(n: int, *, shuffle: bool, seed: int, epoch: int) -> list[int]:
    """The epoch's sample order: the same for every world size, so a position in it outlives a resize."""
    if shuffle:
        gen = torch.Generator().manual_seed(seed + epoch)  # deterministic, different every epoch
        return torch.randperm(n, generator=gen).tolist()
    return list(range(n))


def global_batches(n: int, batch_size: int, world_size: int, *, shuffle: bool, seed: int, epoch: int,
                   drop_last: bool = False, start: int = 0, global_size: int | None = None,
                   shares: Sequence[float] | None = None) -> list[list[list[int]]]:
    """The epoch's plan from sample ``start`` of its order on: ``plan[step][rank]`` is a list of sample indices.

    Global batches hold ``world_size * batch_size`` samples, as one process with that
    batch would take them. The short last one is split as evenly as possible (a
    worker may get an empty part when it holds fewer samples than there are workers)
    and never joins the batch before it, so the step count is one process's.
    ``global_size`` fixes the global batch instead (``phalanx.elastic.KeepGlobalBatch``):
    each one is then split as evenly as possible over ``world_size``. ``shares`` (one per
    rank, summing to 1) splits each global batch in those proportions instead (:func:`split_sizes`).
    """
    order = epoch_order(n, shuffle=shuffle, seed=seed, epoch=epoch)[start:]
    size = global_size or batch_size * world_size
    batches = [order[i:i + size] for i in range(0, len(order), size)]
    if drop_last and batches and len(batches[-1]) < size:
        batches.pop()
    return [_split(b, world_size, shares) for b in batches]


def _split(batch: list[int], world_size: int, shares: Sequence[float] | None = None) -> list[list[int]]:
    """Contiguous parts: near-equal (equal when the batch divides), or in proportion to ``shares``."""
    if shares is None or len(batch) < world_size:
        q, r = divmod(len(batch), world_size)
        sizes = [q + (1 if rank < r else 0) for rank in range(world_size)]
    else:
        sizes = split_sizes(len(batch), shares)
    parts, start = [], 0
    for size in sizes:
        parts.append(batch[start:start + size])
        start += size
    return parts


def split_sizes(total: int, shares: Sequence[float]) -> list[int]:
    """``total`` samples cut in proportion to ``shares`` (largest remainders; ties to low ranks), at least one each.

    Every rank computes the same sizes from the same shares. Equal shares give the
    near-equal split of an unbalanced loader. A worker never gets none while there are
    enough samples: it could not be measured again.

    Example:
        >>> split_sizes(12, [0.75, 0.25]), split_sizes(13, [0.5, 0.5]), split_sizes(4, [0.99, 0.01])
        ([9, 3], [7, 6], [3, 1])
    """
    world, whole = len(shares), sum(shares)
    exact = [total * s / whole for s in shares]
    sizes = [math.floor(x) for x in exact]
    by_remainder = sorted(range(world), key=lambda r: (-(exact[r] - sizes[r]), r))
    for r in by_remainder[:total - sum(sizes)]:
        sizes[r] += 1
    for r in range(world):
        if sizes[r] == 0 and total >= world:
            sizes[max(range(world), key=lambda q: (sizes[q], -q))] -= 1
            sizes[r] = 1
    return sizes


class ShardSampler(Sampler[list[int]]):
    """A batch sampler yielding this worker's part of each global batch; resumable mid-epoch.

    Its position is world-size independent: the epoch, the seed and the number of
    samples of the epoch's order already trained on (by all workers together). A
    state saved by N workers and loaded by M re-splits the rest of the epoch over M,
    so every sample is still trained exactly once per epoch.
    """

    def __init__(self, n: int, batch_size: int, *, rank: int, world_size: int, shuffle: bool,
                 seed: int, drop_last: bool) -> None:
        self.n, self.batch_size, self.rank, self.world_size = n, batch_size, rank, world_size
        self.shuffle, self.seed, self.drop_last = shuffle, seed, drop_last
        self.epoch = 0
        self.samples = 0   # samples of this epoch's order trained on by all workers together
        self.start = 0     # where the current iteration began in that order
        # phalanx.elastic.KeepGlobalBatch sets this: global batches keep this size whatever the world size
        self.global_size: int | None = None
        self.shares: list[float] | None = None  # balance="speed": each rank's part of a global batch (sums to 1)
        self.window: int | None = None  # steps the next iteration takes before the split is measured again

    def reassign(self, rank: int, world_size: int) -> None:
        """Hand out ``rank``'s part of ``world_size`` from the current position on: the rest of the epoch is
        re-split over a new group (the position counts samples, so none is dropped or read twice).

        Example:
            >>> s = ShardSampler(8, 2, rank=0, world_size=2, shuffle=False, seed=0, drop_last=True)
            >>> s.reassign(0, 1); list(s)[0]
            [0, 1]
        """
        self.rank, self.world_size = rank, world_size

    def keep_global_batch(self, size: int | None) -> None:
        """Cut every global batch to ``size`` samples whatever the world size (None: ``batch_size`` per worker);
        ``phalanx.elastic.KeepGlobalBatch`` asks for it at the start and after every regroup.

        Example:
            >>> s = ShardSampler(12, 2, rank=0, world_size=2, shuffle=False, seed=0, drop_last=True)
            >>> s.keep_global_batch(6); list(s)[0]
            [0, 1, 2]
        """
        self.global_size = size

    def set_epoch(self, epoch: int) -> None:
        if epoch != self.epoch:
            self.epoch, self.samples = epoch, 0

    def plan(self) -> list[list[list[int]]]:
        """The rest of this epoch: ``plan[step][rank]``, from the current position on."""
        shares = self.shares if self.shares is not None and len(self.shares) == self.world_size else None
        return global_batches(self.n, self.batch_size, self.world_size, shuffle=self.shuffle, seed=self.seed,
                              epoch=self.epoch, drop_last=self.drop_last, start=self.samples,
                              global_size=self.global_size, shares=shares)

    def __iter__(self) -> Iterator[list[int]]:
        # Starts at the position so a resumed run skips what it already trained on. The
        # loader, not this sampler, advances the position: DataLoader workers prefetch.
        for parts in self.plan()[:self.window]:
            yield parts[self.rank]

    def __len__(self) -> int:
        """Steps in a whole epoch at this world size (the same as one process with batch world_size * batch_size)."""
        size = self.global_size or self.batch_size * self.world_size
        return self.n // size if self.drop_last else -(-self.n // size)

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "seed": self.seed, "samples": self.samples, "n": self.n}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "n" in state and int(state["n"]) != self.n:
            raise ConfigError(usage(f"a loader position saved for a dataset of {int(state['n'])} samples",
                                    f"the same dataset ({self.n} samples here)",
                                    "Resume with the dataset the checkpoint was trained on."))
        self.epoch, self.seed = int(state["epoch"]), int(state["seed"])
        if "samples" in state:
            self.samples = int(state["samples"])
        else:  # written before positions were world-size independent: batches of this world size
            self.samples = min(self.n, int(state["position"]) * self.batch_size * self.world_size)


__all__ = ["ShardSampler", "epoch_order", "global_batches", "split_sizes"]
