"""Sharded data: each worker reads only its own part of every global batch.

The epoch's plan (:mod:`phalanx.data.sampler`) cuts the epoch's permutation into global batches
of ``world_size * batch_size`` samples and splits each one across workers, so N workers with
batch b see, together, exactly the batches one process sees with batch N·b and the same seed.
The loader here reads this worker's part of each: every worker takes the same number of
steps, as many as one process with batch N·b, and on a short last global batch each
worker's gradient is weighted by its share of it (:func:`phalanx.step.clock.set_batch_weight`),
so the step is exactly one process's step on the same samples. With ``balance="speed"`` the
parts follow the workers' measured throughput (:mod:`phalanx.data.balance`).

Example:
    >>> import torch, phalanx as px
    >>> data = torch.utils.data.TensorDataset(torch.arange(10.))
    >>> loader = px.shard(data, batch_size=4, shuffle=True, seed=0)
    >>> loader.set_epoch(0); sum(len(b[0]) for b in loader)
    10
"""
from __future__ import annotations

import time
from typing import Any, Callable, Iterator, Sized

import torch
from torch.utils.data import DataLoader, Dataset, default_collate

from .. import check
from ..group import group
from .hooks import BeforeBatch
from .balance import SpeedBalance, SpeedSource, refuse_unweighted_strategies, seconds_per_sample, shares_from
from ..group.collectives import all_gather_object
from ..errors import ConfigError, usage
from .prefetch import prefetch
from .sampler import ShardSampler, epoch_order, global_batches, split_sizes
from ..group.spans import span
from ..step import telemetry
from ..step.clock import clocks, set_batch_weight


class _EmptySafeCollate:
    """The user's collate, plus zero-length batches (same structure, shapes and dtypes) for empty parts."""

    def __init__(self, collate: Callable[[list[Any]], Any], dataset: Dataset) -> None:
        self.collate, self.dataset = collate, dataset

    def __call__(self, samples: list[Any]) -> Any:
        if samples:
            return self.collate(samples)
        return _empty_like(self.collate([self.dataset[0]]))


def _empty_like(batch: Any) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch[:0]
    if isinstance(batch, (list, tuple)):
        return type(batch)(_empty_like(b) for b in batch)
    if isinstance(batch, dict):
        return {k: _empty_like(v) for k, v in batch.items()}
    return batch


def _waited() -> float:
    """Seconds the wrapped models' step clocks spent waiting for peers so far (:attr:`StepClock.waited`)."""
    return sum(clock.waited for clock in list(clocks()))


class ShardedLoader(BeforeBatch):
    """A DataLoader over this worker's shard, with ``set_epoch`` and a checkpointable position.

    On every step it tells the step clocks of the wrapped models this worker's weight in
    the global mean (:func:`phalanx.step.clock.set_batch_weight`; also ``self.batch_weight``):
    1 on full steps; on the short last step ``n_i * world_size / total``, so the averaged gradient is exactly
    that of one process on the same samples. A worker whose part of that step is empty gets a
    zero-length batch (same shapes and dtypes, zero rows) and weight 0: it still
    takes the step, so no collective is skipped. Models whose forward refuses zero
    rows, and losses that return nan on them with a plain mean, are fine as long as
    the gradient is zero; use ``drop_last=True`` to avoid such steps altogether.
    """

    def __init__(self, dataset: Dataset, sampler: ShardSampler, *, device: torch.device | str | None = None,
                 balance: SpeedBalance | None = None, **loader_kwargs: Any) -> None:
        super().__init__()
        self.dataset, self.sampler, self.balance = dataset, sampler, balance
        self._generation = group.current().generation if balance is not None else 0  # the split's group
        # -- device prefetch (phalanx.data.prefetch): batches arrive on ``device``, copied one step ahead
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
        loader_kwargs["collate_fn"] = _EmptySafeCollate(loader_kwargs.get("collate_fn") or default_collate, dataset)
        self._loader = DataLoader(dataset, batch_sampler=sampler, **loader_kwargs)
        self.batch_weight = 1.0  # this worker's share of the batch last yielded

    def set_epoch(self, epoch: int) -> None:
        """Reshuffle for ``epoch``; call it at the top of every epoch, as with DistributedSampler."""
        self.sampler.set_epoch(epoch)

    def __iter__(self) -> Iterator[Any]:
        s, balance = self.sampler, self.balance
        if balance is not None:
            refuse_unweighted_strategies()  # the model may have been wrapped after px.shard
        while True:  # one window of steps per split: the whole epoch when not balancing
            if balance is not None:
                if balance.due:
                    self._rebalance()
                s.window = balance.every - balance.since
            sizes = [[len(part) for part in parts] for parts in s.plan()[:s.window]]
            if not sizes:
                break
            if self._own_generator:  # deterministic per (seed, epoch, position, rank), whatever happened before
                self._generator.manual_seed(hash((s.seed, s.epoch, s.samples, s.rank)) & (2**63 - 1))
            # The prefetcher reads one batch ahead; the position and the weight follow what was handed out.
            batches = prefetch(self._loader, self.device)
            reporter = telemetry.of()  # `phalanx run --status`: the wait for each batch is the step's input time
            for step_sizes in sizes:
                fetch = time.perf_counter()
                with span("phalanx/data wait"):  # the timeline (phalanx.step.profiling)
                    batch = next(batches)
                fetch = time.perf_counter() - fetch
                self.run_before_batch()
                total = sum(step_sizes)
                s.samples += total
                self.batch_weight = step_sizes[s.rank] * s.world_size / total
                set_batch_weight(self.batch_weight)
                if reporter is not None:
                    reporter.input_waited(fetch, step_sizes[s.rank], step_sizes[s.rank] / total)
                if balance is None:
                    yield batch
                    continue
                balance.handed_out(step_sizes[s.rank])
                waited, out = _waited(), time.perf_counter()
                yield batch
                # this worker's own work on the batch: loading it, and its step less the wait for its peers
                balance.worked(fetch + time.perf_counter() - out - (_waited() - waited))
            if balance is None:
                break
        s.window = None
        self.batch_weight = 1.0
        set_batch_weight(1.0)
        s.samples = 0  # the epoch is done; iterating again replays it unless set_epoch moves on

    def _rebalance(self) -> None:
        """Collective (every rank at the same step): all-gather the speeds, split the next batches by them."""
        mine = self.balance.measure()  # type: ignore[union-attr]
        seconds = all_gather_object(mine, "the workers' speeds (px.shard balance='speed')")
        if len(seconds) != self.sampler.world_size or group.current().generation != self._generation:
            self.sampler.shares, self._generation = None, group.current().generation  # regrouped: equal again
            return
        self.sampler.shares = shares_from(seconds) or self.sampler.shares

    def __len__(self) -> int:
        return len(self.sampler)

    def steps_left(self) -> int:
        """Steps the next iteration will take (fewer than ``len`` when resumed mid-epoch)."""
        return len(self.sampler.plan())

    @property
    def batch_size(self) -> int:
        return self.sampler.batch_size

    def state_dict(self) -> dict[str, Any]:
        """The position, world-size independent: ``epoch``, ``seed``, ``samples`` trained on this epoch, ``n``.

        With ``balance="speed"`` also the current split (``shares``), the steps since it was
        measured (``since``) and the group generation it was measured in.
        """
        state = self.sampler.state_dict()
        if self.balance is not None:
            state["balance"] = {"shares": self.sampler.shares, "since": self.balance.since,
                                "generation": self._generation}
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state``; under another world size, or after a regroup, the rest of the epoch is re-split
        (evenly, until the speeds are measured again)."""
        self.sampler.load_state_dict(state)
        saved = state.get("balance")
        if self.balance is not None and saved is not None:
            same_group = int(saved["generation"]) == group.current().generation
            shares = saved["shares"]
            self.sampler.shares = [float(x) for x in shares] if shares is not None and same_group else None
            self.balance.since = int(saved["since"]) if same_group else 0
            self._generation = group.current().generation


def shard(dataset: Dataset, batch_size: int, *, shuffle: bool = True, seed: int = 0, drop_last: bool = False,
          rank: int | None = None, world_size: int | None = None, device: torch.device | str | None = None,
          balance: str | None = None, rebalance_every: int | None = None, speed: SpeedSource | None = None,
          **loader_kwargs: Any) -> ShardedLoader:
    """A loader that yields this worker's part of each global batch of ``world_size * batch_size``.

    Extra keyword arguments (``num_workers``, ``pin_memory``, ``collate_fn``...) go to DataLoader.
    ``device`` (e.g. ``px.device()``): batches arrive on it; on a GPU the next batch is copied from
    pinned memory on a side stream while the current step computes (see :mod:`phalanx.data.prefetch`).

    ``balance="speed"``: workers of uneven speed. The global batch (``world_size * batch_size``)
    is split in proportion to each worker's measured throughput, measured again every
    ``rebalance_every`` steps (default 200); see :mod:`phalanx.data.balance`. ``speed`` replaces the
    measurement: a function of (samples, busy seconds) since the last one that returns this
    worker's seconds per sample.

    ``shuffle`` defaults to True, as ``DistributedSampler``'s does. Porting a loop
    whose ``DataLoader(..., shuffle=False, sampler=DistributedSampler(...))`` said
    ``shuffle=False`` only because a sampler was given: do not carry that over, or
    shuffling is off (the sampler did the shuffling there).

    Example:
        >>> import torch, phalanx as px
        >>> ds = torch.utils.data.TensorDataset(torch.randn(8, 3), torch.arange(8))
        >>> len(px.shard(ds, batch_size=2, rank=0, world_size=2))
        2
    """
    check.positive_int("batch_size", batch_size, "Pass e.g. batch_size=64 (samples per worker per step).")
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
    return ShardedLoader(dataset, sampler, device=device, balance=_balance(balance, rebalance_every, speed),
                         **loader_kwargs)


def _balance(balance: str | None, every: int | None, speed: SpeedSource | None) -> SpeedBalance | None:
    """Check ``px.shard``'s balance arguments (one line each) and build the measurement."""
    if balance is None:
        if every is not None or speed is not None:
            given = "rebalance_every=" if every is not None else "speed="
            raise ConfigError(usage(f"px.shard(..., {given}) without balance=", "balance='speed' with it",
                                    "Pass balance='speed' too, or drop it."))
        return None
    if balance != "speed":
        raise ConfigError(usage(f"px.shard(..., balance={balance!r})", "balance='speed' or None",
                                "Pass balance='speed' to split each global batch by the workers' throughput."))
    every = check.positive_int("px.shard(rebalance_every", 200 if every is None else every,
                               "Measure the speeds every few hundred steps, e.g. rebalance_every=200.", close=")")
    if speed is not None and not callable(speed):
        raise ConfigError(usage(f"px.shard(speed={speed!r})", "a function (samples, busy_seconds) -> seconds per "
                                "sample", "Leave speed unset to measure the workers' own time."))
    refuse_unweighted_strategies()
    return SpeedBalance(every, speed)


# The loader, and the plan's and the balance's public names from before they had modules of their own
# (``from phalanx.data.loader import global_batches`` still works); new code imports those from phalanx.data.sampler and
# phalanx.data.balance.
__all__ = ["ShardSampler", "ShardedLoader", "SpeedBalance", "SpeedSource", "epoch_order", "global_batches",
           "refuse_unweighted_strategies", "seconds_per_sample", "shard", "shares_from", "split_sizes"]
