"""px.keras.shard: each worker reads only its part of every global batch, as a ``keras.utils.PyDataset``.

The plan is phalanx's own (:func:`phalanx.data.sampler.global_batches`): the epoch's
permutation is cut into global batches of ``world_size * batch_size`` samples and
each is split across workers, so N workers with batch b see exactly the batches one
process sees with batch N*b and the same seed. Every sample of an epoch goes to one
worker and every worker takes the same number of steps; a short last batch is split
as evenly as possible (never padded), which keeps validation metrics exact.

A training tail smaller than the number of workers is its own step, as in plain Keras
(same step count, same schedule): a worker whose part is empty gets a stand-in, one
sample with sample weight 0 and batch weight 0, since a Keras step cannot be empty (its
loss of zero samples is an empty tensor). Every batch of that dataset then carries a
sample weight (ones where the user gave none: the same loss), and ``px.keras.wrap``'s
``fit`` leaves the stand-in out of every metric. Validation data merges such a tail
into the step before it instead; evaluation has no schedule, and its metrics stay exact.

Accepted sources: NumPy arrays (``x``, optional ``y`` and ``sample_weight``; ``x`` may
be a list or dict of arrays), a map-style torch ``Dataset`` (samples collated with
torch's ``default_collate``), and a ``keras.utils.PyDataset`` whose items are batches
(its batches are dealt round-robin: worker r reads batches r, r+N, ...).

Example:
    >>> import numpy as np
    >>> ds = shard(np.zeros((10, 3)), np.arange(10), batch_size=2, rank=1, world_size=2, shuffle=False)
    >>> len(ds), ds[0][1].tolist(), ds[2][1].tolist()
    (3, [2, 3], [9])
"""
from __future__ import annotations

import hashlib
from typing import Any

import numpy as np
import torch

from ..group import group
from ..errors import ConfigError, usage
from ..data.sampler import global_batches
from .detect import is_tf_dataset
from .keras_api import keras


def _rows(data: Any, idx: list[int]) -> Any:
    """``data`` restricted to the rows ``idx`` (arrays, or lists/dicts of arrays)."""
    if data is None:
        return None
    if isinstance(data, dict):
        return {k: _rows(v, idx) for k, v in data.items()}
    if isinstance(data, (list, tuple)):
        return type(data)(_rows(v, idx) for v in data)
    return data[np.asarray(idx, dtype=np.int64)]


def _length(data: Any) -> int:
    if isinstance(data, dict):
        data = next(iter(data.values()))
    if isinstance(data, (list, tuple)):
        data = data[0]
    return len(data)


class ShardedDataset(keras.utils.PyDataset):
    """This worker's batches; :meth:`set_epoch` reshuffles (``px.keras.wrap``'s ``fit`` calls it)."""

    def __init__(self, source: Any, n: int, batch_size: int, *, rank: int, world_size: int, shuffle: bool,
                 seed: int, **pydataset_kwargs: Any) -> None:
        super().__init__(**pydataset_kwargs)
        self.source, self.n, self.batch_size = source, n, batch_size
        self.rank, self.world_size, self.shuffle, self.seed = rank, world_size, shuffle, seed
        self.epoch = 0
        self.empty_parts = False  # True for training data (keep_short_tail): a short tail is its own step
        # Where this plan starts in the epoch: ``start`` samples of its order and ``first_step`` steps were trained
        # before (an elastic fit resumed mid-epoch, possibly over another number of workers); ``begun``: the steps
        # of this plan whose batch has begun (:meth:`begin`).
        self.start = self.first_step = self.begun = 0
        self._plan = self._make_plan()
        self._digest: bytes | None = None

    def keep_short_tail(self) -> None:
        """Train on a tail smaller than the number of workers as its own step (stand-ins for empty parts).

        Called by ``px.keras.wrap``'s ``fit`` for the training data, so the step count and the
        schedule are plain Keras's.
        """
        self.empty_parts = True
        self._plan = self._make_plan()

    @property
    def has_stand_ins(self) -> bool:
        """Some worker's part of some step is empty: every batch then carries a sample weight."""
        return any(not part for parts in self._plan for part in parts)

    def _make_plan(self) -> list[list[list[int]]]:
        plan = global_batches(self.n, self.batch_size, self.world_size, shuffle=self.shuffle,
                              seed=self.seed, epoch=self.epoch, start=self.start)
        if not self.empty_parts and len(plan) > 1 and any(not part for part in plan[-1]):
            # A tail smaller than the number of workers would leave some worker an empty batch, and Keras
            # reports nan for the mean loss of zero samples (nan * 0 is still nan in its Mean tracker).
            # Keras steps cannot be empty, so such a tail joins the step before it, split evenly.
            tail = plan.pop()
            merged = [i for part in plan.pop() for i in part] + [i for part in tail for i in part]
            size, extra = divmod(len(merged), self.world_size)
            bounds = [r * size + min(r, extra) for r in range(self.world_size + 1)]
            plan.append([merged[bounds[r]:bounds[r + 1]] for r in range(self.world_size)])
        return plan

    def set_epoch(self, epoch: int) -> None:
        """Use ``epoch``'s permutation (deterministic in ``seed + epoch``, as ``px.shard``)."""
        if epoch != self.epoch:
            self.epoch, self.start, self.first_step, self.begun = epoch, 0, 0, 0
            self._plan = self._make_plan()

    # -- the position, for an elastic fit (phalanx.keras.supervised) ------------------------------------------------
    def begin(self, step: int) -> None:
        """Step ``step`` of this plan is about to train: the position is just before its batch."""
        self.begun = step

    @property
    def samples(self) -> int:
        """Samples of this epoch's order trained before the position."""
        return self.start + sum(len(part) for parts in self._plan[:self.begun] for part in parts)

    @property
    def step_in_epoch(self) -> int:
        """Steps of this epoch trained before the position (Keras's batch index of the next step)."""
        return self.first_step + self.begun

    def finish_epoch(self) -> None:
        """Every step of the epoch has trained: the position is its end."""
        self.begun = len(self._plan)

    @property
    def epoch_done(self) -> bool:
        return self.samples >= self.n

    def state_dict(self) -> dict[str, Any]:
        """The position: the epoch, and the samples and steps of it trained (independent of the world size)."""
        return {"epoch": self.epoch, "samples": self.samples, "steps": self.step_in_epoch, "n": self.n}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Go back to a position :meth:`state_dict` gave; the rest of that epoch is planned for this world."""
        self.epoch, self.start, self.first_step, self.begun = (int(state["epoch"]), int(state["samples"]),
                                                                int(state["steps"]), 0)
        self._plan = self._make_plan()

    def reassign(self, rank: int, world_size: int) -> None:
        """Re-split the rest of the epoch, from the position on, over ``world_size`` workers (none dropped or
        read twice)."""
        self.start, self.first_step = self.samples, self.step_in_epoch
        self.rank, self.world_size, self.begun = rank, world_size, 0
        self._plan = self._make_plan()

    # -- the data's digest (every worker must be given the same arrays) ---------------------------------------------
    def digest(self) -> bytes | None:
        """SHA-256 over the arrays' dtypes, shapes and bytes (x, y, sample_weight); None for a torch Dataset.

        Computed once per dataset object: the arrays are the user's and ``fit`` does not change them.
        """
        if self._digest is None and not isinstance(self.source[0], _TorchSource):
            h = hashlib.sha256()
            for name, part in zip(("x", "y", "sample_weight"), self.source):
                h.update(name.encode())
                _hash_into(h, part)
            self._digest = h.digest()
        return self._digest

    def batch_weight(self, step: int) -> float:
        """This worker's weight in the mean gradient of ``step``: ``n_rank * world_size / n_global``."""
        parts = self._plan[step]
        return len(parts[self.rank]) * self.world_size / sum(len(p) for p in parts)

    def __len__(self) -> int:
        return len(self._plan)

    def __getitem__(self, step: int) -> Any:
        parts = self._plan[step]
        idx = parts[self.rank]
        x, y, w = self.source
        if not self.has_stand_ins:
            if y is None and w is None:
                return _rows(x, idx)  # a torch Dataset's collated (x, y[, w]), or inputs alone for predict
            return tuple(part for part in (_rows(x, idx), _rows(y, idx), _rows(w, idx)) if part is not None)
        stand_in = not idx
        if stand_in:  # one sample of this step, weighted 0: a finite loss of 0 and a zero gradient
            idx = next(part for part in parts if part)[:1]
        if y is None and w is None:
            batch = _rows(x, idx)
            if not isinstance(batch, tuple) or len(batch) not in (2, 3):
                return batch  # inputs alone: nothing to weight (batch weight 0 still zeroes the gradient)
            bx, by, bw = batch if len(batch) == 3 else (*batch, None)
        else:
            bx, by, bw = _rows(x, idx), _rows(y, idx), _rows(w, idx)
        weights = np.ones(len(idx), dtype="float32") if bw is None else np.asarray(bw, dtype="float32")
        return bx, by, weights * 0 if stand_in else weights


def _hash_into(h: Any, data: Any) -> None:
    """Feed ``data`` (arrays, or lists/dicts of arrays) into the hash ``h``, structure included."""
    if data is None:
        h.update(b"none")
    elif isinstance(data, dict):
        for key in sorted(data, key=str):
            h.update(f"key:{key}".encode())
            _hash_into(h, data[key])
    elif isinstance(data, (list, tuple)):
        h.update(f"seq:{len(data)}".encode())
        for part in data:
            _hash_into(h, part)
    else:
        arr = np.ascontiguousarray(np.asarray(data.detach().cpu() if hasattr(data, "detach") else data))
        h.update(f"{arr.dtype.str}{arr.shape}".encode())
        h.update(memoryview(arr).cast("B") if arr.dtype != object else repr(arr.tolist()).encode())


def check_same_data(comm: Any, named: dict[str, Any]) -> None:
    """Refuse workers that were given different arrays (collective: one all-gather of the digests).

    ``px.keras.shard`` takes each worker's part of the *same* arrays; a worker that loaded
    or shuffled its own copy differently (``np.random.shuffle`` without a seed) would train
    on samples the plan never meant, twice or never, with no error. Every worker compares
    every worker's digest, so every worker raises the same :class:`ConfigError`.

    Example:
        >>> from phalanx.group.collectives import Comm
        >>> check_same_data(Comm(), {"x": shard(np.zeros((4, 2)), np.zeros(4), batch_size=2)})
    """
    if comm.world_size == 1:
        return
    names = [n for n, d in named.items() if isinstance(d, ShardedDataset) and d.digest() is not None]
    if not names:
        return
    mine = np.frombuffer(b"".join(named[n].digest() for n in names), dtype=np.int64)
    every = [t.numpy().tobytes() for t in comm.all_gather(torch.from_numpy(mine.copy()))]
    for i, name in enumerate(names):
        digests = [d[32 * i:32 * (i + 1)] for d in every]
        differ = [r for r, d in enumerate(digests) if d != digests[0]]
        if differ:
            raise ConfigError(usage(
                f"workers given different {name} arrays (the digest of worker {differ[0]}'s differs from "
                f"worker 0's: {digests[differ[0]].hex()[:12]} vs {digests[0].hex()[:12]})",
                "the same arrays on every worker (px.keras.shard takes each worker's part of them)",
                "Load and shuffle the data the same way on every worker: seed any shuffle before it "
                "(np.random.default_rng(0)), or leave the shuffling to px.keras.shard(seed=...)."))


class _TorchSource:
    """A map-style torch Dataset read sample by sample and collated, so ``_rows`` works on it."""

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, idx: np.ndarray) -> Any:
        from torch.utils.data import default_collate
        batch = default_collate([self.dataset[int(i)] for i in idx])
        return tuple(batch) if isinstance(batch, list) else batch


class ShardedBatches(keras.utils.PyDataset):
    """A user's PyDataset dealt round-robin: worker r reads batches r, r+N, ... .

    When the number of batches does not divide by N, the last step's leftover batches
    are concatenated and split by rows, so every worker still takes the same number of
    steps and every sample is seen once.
    """

    def __init__(self, batches: Any, *, rank: int, world_size: int, **pydataset_kwargs: Any) -> None:
        super().__init__(**pydataset_kwargs)
        self.batches, self.rank, self.world_size = batches, rank, world_size
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return -(-len(self.batches) // self.world_size)

    def _tail(self) -> tuple[int, int]:
        full = len(self.batches) // self.world_size
        return full, len(self.batches) - full * self.world_size

    def _tail_batch(self) -> tuple[Any, list[int], int]:
        full, leftover = self._tail()
        parts = [self.batches[full * self.world_size + i] for i in range(leftover)]
        joined = [np.concatenate([np.asarray(p[j]) for p in parts]) for j in range(len(parts[0]))] \
            if isinstance(parts[0], tuple) else [np.concatenate([np.asarray(p) for p in parts])]
        total = len(joined[0])
        q, r = divmod(total, self.world_size)
        sizes = [q + (1 if k < r else 0) for k in range(self.world_size)]
        return joined, sizes, total

    def batch_weight(self, step: int) -> float:
        full, leftover = self._tail()
        if step < full or not leftover:
            return 1.0  # equal-sized batches assumed, as Keras assumes on one process
        _, sizes, total = self._tail_batch()
        return sizes[self.rank] * self.world_size / total

    def __getitem__(self, step: int) -> Any:
        full, leftover = self._tail()
        if step < full:
            return self.batches[step * self.world_size + self.rank]
        joined, sizes, _ = self._tail_batch()
        start = sum(sizes[:self.rank])
        rows = list(range(start, start + sizes[self.rank]))
        out = tuple(j[rows] for j in joined)
        return out if len(out) > 1 else out[0]

    def on_epoch_end(self) -> None:
        self.batches.on_epoch_end()


def shard(x: Any, y: Any = None, *, batch_size: int | None = None, sample_weight: Any = None, shuffle: bool = True,
          seed: int = 0, rank: int | None = None, world_size: int | None = None,
          **pydataset_kwargs: Any) -> keras.utils.PyDataset:
    """This worker's part of ``x`` (and ``y``), for ``model.fit`` / ``evaluate`` of a wrapped model.

    ``batch_size`` is per worker; the global batch is ``world_size * batch_size``.
    Extra keyword arguments (``workers``, ``use_multiprocessing``, ``max_queue_size``)
    go to ``keras.utils.PyDataset`` for asynchronous feeding.

    Example:
        >>> import numpy as np
        >>> len(shard(np.zeros((9, 2)), np.zeros(9), batch_size=4, rank=0, world_size=1))
        3
    """
    world = group.world_size() if world_size is None else world_size
    me = group.rank() if rank is None else rank
    if is_tf_dataset(x):
        raise ConfigError(usage("a tf.data.Dataset", "NumPy arrays, a keras.utils.PyDataset or a torch Dataset",
                                "phalanx cannot split a tf.data pipeline exactly across workers; pass the arrays, "
                                "or wrap your loading code in a keras.utils.PyDataset."))
    if isinstance(x, keras.utils.PyDataset):
        if y is not None or sample_weight is not None or batch_size is not None:
            raise ConfigError(usage("a PyDataset together with y/sample_weight/batch_size",
                                    "a PyDataset alone (its items are batches)", "Drop the extra arguments."))
        if len(x) < world:
            raise ConfigError(usage(f"a PyDataset of {len(x)} batches for {world} workers",
                                    f"at least {world} batches", "Use smaller batches or fewer workers."))
        return ShardedBatches(x, rank=me, world_size=world, **pydataset_kwargs)
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ConfigError(usage(f"batch_size={batch_size!r}", "an integer >= 1 (samples per worker per step)",
                                "Pass e.g. px.keras.shard(x, y, batch_size=64)."))
    if _is_torch_dataset(x):
        if y is not None or sample_weight is not None:
            raise ConfigError(usage("a torch Dataset together with y/sample_weight",
                                    "a Dataset whose samples are (x, y) or (x, y, sample_weight)",
                                    "Put the targets in the dataset's samples."))
        source, n = (_TorchSource(x), None, None), len(x)
    elif _is_array_like(x):
        n = _length(x)
        for name, part in (("y", y), ("sample_weight", sample_weight)):
            if part is not None and _length(part) != n:
                raise ConfigError(usage(f"{name} with {_length(part)} rows for x with {n}", "the same row count",
                                        "Pass matching arrays."))
        source = (x, y, sample_weight)
    else:
        raise ConfigError(usage(f"data of type {type(x).__name__}",
                                "NumPy arrays, a keras.utils.PyDataset or a map-style torch Dataset",
                                "Convert it with np.asarray, or wrap it in a PyDataset."))
    if n < world:
        raise ConfigError(usage(f"{n} samples for {world} workers", f"at least one sample per worker ({world})",
                                "Use fewer workers or more data."))
    return ShardedDataset(source, n, batch_size, rank=me, world_size=world, shuffle=shuffle, seed=seed,
                          **pydataset_kwargs)


def _is_torch_dataset(x: Any) -> bool:
    from torch.utils.data import Dataset
    return isinstance(x, Dataset) and hasattr(x, "__len__")


def _is_array_like(x: Any) -> bool:
    if isinstance(x, dict):
        return bool(x) and all(_is_array_like(v) for v in x.values())
    if isinstance(x, (list, tuple)):
        return bool(x) and all(_is_array_like(v) for v in x)
    return hasattr(x, "shape") and hasattr(x, "__getitem__") and len(getattr(x, "shape", ())) >= 1


def is_sharded(data: Any) -> bool:
    """True for what :func:`shard` returns."""
    return isinstance(data, (ShardedDataset, ShardedBatches))
