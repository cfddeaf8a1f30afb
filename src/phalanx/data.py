"""Sharded data: each worker reads only its own part of every global batch.

The epoch's permutation is cut into global batches of ``world_size * batch_size``
samples and each global batch is split across workers. So N workers with batch b
see, together, exactly the batches one process sees with batch N·b and the same
seed, which is what makes distributed training checkable against one process.
Every sample of an epoch goes to exactly one worker and every worker takes the
same number of steps, as many as one process with batch N·b: a short last global
batch is split as evenly as possible (a part may be empty), and each worker's
gradient is weighted by its share of it (:func:`phalanx.steps.set_batch_weight`), so the step
is exactly one process's step on the same samples.

**Workers of uneven speed** (``balance="speed"``): the global batch keeps its size but is
split in proportion to each worker's measured throughput, so a synchronous step no
longer waits for the slowest worker to finish a full equal part. Every ``rebalance_every``
steps each worker reports the seconds per sample of its own work (its step time less the
time it waited for peers in the exchange, :attr:`phalanx.steps.StepClock.waited`); the
reports are all-gathered and the next global batches, still contiguous slices of the
shared epoch order, are cut in proportion to 1 / seconds per sample (each worker keeps at
least one sample). Every sample is still trained once per epoch, and the batch weights
keep each step one process's step on the same global batch. Only strategies that weight
workers by their share accept uneven parts (``Strategy.uneven_batches``: AllReduce,
LocalSGD, DiLoCo, the synchronous parameter server); the split lives in the loader's
``state_dict``, and returns to equal after an elastic regroup.

Example:
    >>> import torch, phalanx as px
    >>> data = torch.utils.data.TensorDataset(torch.arange(10.))
    >>> loader = px.shard(data, batch_size=4, shuffle=True, seed=0)
    >>> loader.set_epoch(0); sum(len(b[0]) for b in loader)
    10
"""
from __future__ import annotations

import math
import time
from collections import OrderedDict
from typing import Any, Callable, Iterator, Sequence, Sized

import torch
from torch.utils.data import DataLoader, Dataset, Sampler, default_collate
from torch.utils.hooks import RemovableHandle

from . import check, group
from .comm import all_gather_object
from .errors import ConfigError, usage
from .prefetch import prefetch
from .spans import span
from .steps import set_batch_weight


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


SpeedSource = Callable[[int, float], float]
"""This worker's seconds per sample, from the samples it trained and its busy seconds since the last call."""


def seconds_per_sample(samples: int, busy_s: float) -> float:
    """The default speed source: busy seconds over samples (nan before any sample, which keeps the split)."""
    return busy_s / samples if samples > 0 else math.nan


class SpeedBalance:
    """``px.shard(..., balance="speed")``'s measurement: busy time and samples since the split was last set.

    Example:
        >>> b = SpeedBalance(every=2)
        >>> for _ in range(2):
        ...     b.handed_out(8); b.worked(0.4)
        >>> b.due, b.measure()
        (True, 0.05)
    """

    def __init__(self, every: int, speed: SpeedSource | None = None) -> None:
        self.every, self.speed = every, speed or seconds_per_sample
        self.since = 0  # steps handed out since the split was last set
        self.samples, self.busy = 0, 0.0

    @property
    def due(self) -> bool:
        return self.since >= self.every

    def handed_out(self, samples: int) -> None:
        """A step's batch of ``samples`` went to this worker (counted at once: a loop may stop right after)."""
        self.since += 1
        self.samples += samples

    def worked(self, busy_s: float) -> None:
        """The seconds this worker spent on that batch, waiting for peers left out."""
        self.busy += max(busy_s, 0.0)

    def measure(self) -> float:
        """This worker's seconds per sample since the last measurement (``speed``'s answer); starts a new one."""
        value = float(self.speed(self.samples, self.busy))
        self.since, self.samples, self.busy = 0, 0, 0.0
        return value


def shares_from(seconds: Sequence[float]) -> list[float] | None:
    """Each worker's part of a global batch, in proportion to its throughput; None if a measurement is unusable.

    Example:
        >>> shares_from([0.01, 0.03]), shares_from([0.01, float("nan")])
        ([0.75, 0.25], None)
    """
    if not seconds or not all(math.isfinite(s) and s > 0 for s in seconds):
        return None
    rates = [1.0 / s for s in seconds]
    return [r / sum(rates) for r in rates]


def refuse_unweighted_strategies() -> None:
    """Refuse ``balance="speed"`` beside a wrapped model whose strategy counts every worker alike."""
    for clock in list(group.clocks()):
        strategy = clock.strategy
        if strategy is not None and not getattr(strategy, "uneven_batches", False):
            raise ConfigError(usage(
                f"px.shard(..., balance='speed') with strategy {type(strategy).__name__}",
                "a strategy that weights each worker by its share of the global batch (px.AllReduce, px.LocalSGD, "
                "px.DiLoCo, px.ParameterServer(sync=True)): this one counts every worker alike, or has no global "
                "batch", "Drop balance=, or use px.AllReduce(); asynchronous rules (px.Downpour, px.AsyncEASGD) "
                "already let a fast worker run ahead."))


def _waited() -> float:
    """Seconds the wrapped models' step clocks spent waiting for peers so far (:attr:`StepClock.waited`)."""
    return sum(clock.waited for clock in list(group.clocks()))


class ShardedLoader:
    """A DataLoader over this worker's shard, with ``set_epoch`` and a checkpointable position.

    On every step it tells the step clocks of the wrapped models this worker's weight in
    the global mean (:func:`phalanx.steps.set_batch_weight`; also ``self.batch_weight``):
    1 on full steps; on the short last step ``n_i * world_size / total``, so the averaged gradient is exactly
    that of one process on the same samples. A worker whose part of that step is empty gets a
    zero-length batch (same shapes and dtypes, zero rows) and weight 0: it still
    takes the step, so no collective is skipped. Models whose forward refuses zero
    rows, and losses that return nan on them with a plain mean, are fine as long as
    the gradient is zero; use ``drop_last=True`` to avoid such steps altogether.
    """

    def __init__(self, dataset: Dataset, sampler: ShardSampler, *, device: torch.device | str | None = None,
                 balance: SpeedBalance | None = None, **loader_kwargs: Any) -> None:
        self.dataset, self.sampler, self.balance = dataset, sampler, balance
        self._generation = group.current().generation if balance is not None else 0  # the split's group
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
        loader_kwargs["collate_fn"] = _EmptySafeCollate(loader_kwargs.get("collate_fn") or default_collate, dataset)
        self._loader = DataLoader(dataset, batch_sampler=sampler, **loader_kwargs)
        self.batch_weight = 1.0  # this worker's share of the batch last yielded
        self._before_batch: OrderedDict[int, Callable[[], None]] = OrderedDict()  # RemovableHandle: weakref-able

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
            for step_sizes in sizes:
                fetch = time.perf_counter()
                with span("phalanx/data wait"):  # the timeline (phalanx.profiling)
                    batch = next(batches)
                fetch = time.perf_counter() - fetch
                for hook in list(self._before_batch.values()):
                    hook()
                total = sum(step_sizes)
                s.samples += total
                self.batch_weight = step_sizes[s.rank] * s.world_size / total
                set_batch_weight(self.batch_weight)
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

    def before_batch(self, hook: Callable[[], None]) -> RemovableHandle:
        """Call ``hook()`` each time a batch is about to be handed out, before the position moves past it.

        The step before is then over on every rank, whether its ``optimizer.step()`` ran or was
        skipped: ``px.elastic`` commits here. Returns a handle whose ``remove()`` undoes it.
        """
        handle = RemovableHandle(self._before_batch)
        self._before_batch[handle.id] = hook
        return handle

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
    pinned memory on a side stream while the current step computes (see :mod:`phalanx.prefetch`).

    ``balance="speed"``: workers of uneven speed. The global batch (``world_size * batch_size``)
    is split in proportion to each worker's measured throughput, measured again every
    ``rebalance_every`` steps (default 200); see the module docstring. ``speed`` replaces the
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
