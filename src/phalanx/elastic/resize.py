"""What a membership change keeps: the per-worker batch or the global batch.

When the world size changes from ``before`` to ``after`` workers, one of two things
can stay the same:

- :class:`KeepWorkerBatch` (the default): every worker keeps its batch, so the global
  batch grows or shrinks by ``after / before``. The learning-rate rules of
  ``px.scale_lr`` apply; the policy offers the factor (``lr_factor``) and calls your
  ``on_resize`` with it, e.g. :func:`rescale_lr` to scale every group's lr linearly.
- :class:`KeepGlobalBatch`: the global batch stays the size it had at the start and
  is re-split over the new world size. When it does not divide evenly some workers
  take one sample more; each worker's gradient is weighted by its share
  (:func:`phalanx.step.clock.set_batch_weight`), so a step equals one process's step on the same
  global batch and the learning rate needs no change.

The policy's state (the global batch) rides in every commit, so a joiner that takes
rank 0's state keeps the same global batch.

Example:
    >>> import torch, phalanx as px
    >>> px.elastic.KeepWorkerBatch().lr_factor(before=4, after=2)
    0.5
    >>> px.elastic.KeepGlobalBatch().lr_factor(before=4, after=2)
    1.0
    >>> opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.4)
    >>> policy = px.elastic.KeepWorkerBatch(on_resize=px.elastic.rescale_lr(opt))
    >>> policy.resized(None, before=4, after=2); opt.param_groups[0]["lr"]
    0.2
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from ..errors import ConfigError, usage


@dataclass(frozen=True)
class Resize:
    """One membership change as a resize policy sees it: world sizes and the lr factor its rule gives."""

    before: int
    after: int
    lr_factor: float


class ResizePolicy:
    """The base of the resize policies: what to keep when the world size changes.

    Args:
        on_resize: called with a :class:`Resize` after every change, once the state is
            restored (its lr is the commit's, the lr for the commit's world size); use it to
            rescale the learning rate or anything else that depends on the global batch.
    """

    def __init__(self, on_resize: Callable[[Resize], Any] | None = None) -> None:
        if on_resize is not None and not callable(on_resize):
            raise ConfigError(usage(f"on_resize={on_resize!r}", "a function taking a px.elastic.Resize",
                                    "Pass e.g. on_resize=px.elastic.rescale_lr(optimizer), or leave it out."))
        self.on_resize = on_resize

    def start(self, loader: Any, world_size: int) -> None:
        """At the first commit: note what must be kept (nothing here)."""

    def lr_factor(self, *, before: int, after: int) -> float:
        """How the learning rate should scale when the world size goes from ``before`` to ``after``."""
        return 1.0

    def resized(self, loader: Any, *, before: int, after: int) -> None:
        """After a change (and after the state was restored): re-split the loader, tell ``on_resize``."""
        self.apply(loader, after)
        if self.on_resize is not None and before != after:
            self.on_resize(Resize(before, after, self.lr_factor(before=before, after=after)))

    def apply(self, loader: Any, world_size: int) -> None:
        """Point the loader's batches at ``world_size`` workers (nothing here)."""

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


class KeepWorkerBatch(ResizePolicy):
    """Every worker keeps its batch; the global batch follows the world size (linear lr factor ``after/before``).

    Example:
        >>> KeepWorkerBatch().lr_factor(before=2, after=3)
        1.5
    """

    def lr_factor(self, *, before: int, after: int) -> float:
        return after / before

    def __repr__(self) -> str:
        return "KeepWorkerBatch()"


class KeepGlobalBatch(ResizePolicy):
    """The global batch stays ``global_batch`` samples, re-split over whoever is left (lr unchanged).

    Args:
        global_batch: the samples per step over all workers; default: the loader's batch
            times the world size at the first commit.
        on_resize: as for :class:`ResizePolicy`.

    Needs a ``px.shard`` loader (it re-splits the sampler's global batches).

    Example:
        >>> KeepGlobalBatch(global_batch=12)
        KeepGlobalBatch(global_batch=12)
    """

    def __init__(self, global_batch: int | None = None, *, on_resize: Callable[[Resize], Any] | None = None) -> None:
        super().__init__(on_resize)
        if global_batch is not None and (isinstance(global_batch, bool) or not isinstance(global_batch, int)
                                         or global_batch < 1):
            raise ConfigError(usage(f"KeepGlobalBatch(global_batch={global_batch!r})", "an integer >= 1 or None",
                                    "Pass the samples per step over all workers, or leave it out to keep the "
                                    "batch you start with."))
        self.global_batch = global_batch

    def start(self, loader: Any, world_size: int) -> None:
        sampler = getattr(loader, "sampler", None)
        if sampler is None or not hasattr(sampler, "keep_global_batch"):
            raise ConfigError(usage(f"KeepGlobalBatch with a loader of type {type(loader).__name__}",
                                    "a px.shard loader passed to px.elastic.State(model, opt, loader, ...)",
                                    "Build the loader with px.shard(dataset, batch_size), or use KeepWorkerBatch()."))
        if self.global_batch is None:
            self.global_batch = sampler.batch_size * world_size
        self.apply(loader, world_size)

    def apply(self, loader: Any, world_size: int) -> None:
        sampler = getattr(loader, "sampler", None)
        if sampler is not None and self.global_batch is not None:
            sampler.keep_global_batch(self.global_batch)  # the sampler's own field, set by its own method

    def state_dict(self) -> dict[str, Any]:
        return {"global_batch": self.global_batch}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("global_batch") is not None:
            self.global_batch = int(state["global_batch"])

    def __repr__(self) -> str:
        return f"KeepGlobalBatch(global_batch={self.global_batch})"


def rescale_lr(optimizer: torch.optim.Optimizer) -> Callable[[Resize], None]:
    """An ``on_resize`` that multiplies every param group's lr by the policy's factor (the linear scaling rule).

    Example:
        >>> opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.3)
        >>> rescale_lr(opt)(Resize(before=3, after=2, lr_factor=2 / 3)); round(opt.param_groups[0]["lr"], 6)
        0.2
    """
    def scale(resize: Resize) -> None:
        for group in optimizer.param_groups:
            group["lr"] = group["lr"] * resize.lr_factor
    return scale


def check_policy(resize: Any) -> ResizePolicy:
    """``resize=`` as given to ``px.elastic.State`` or ``Trainer.fit``: a policy object (None: KeepWorkerBatch)."""
    if resize is None:
        return KeepWorkerBatch()
    if not isinstance(resize, ResizePolicy):
        raise ConfigError(usage(f"resize={resize!r}", "px.elastic.KeepWorkerBatch() or px.elastic.KeepGlobalBatch()",
                                "Pass one of the two policy objects (or leave resize out to keep the per-worker "
                                "batch)."))
    return resize


__all__ = ["KeepGlobalBatch", "KeepWorkerBatch", "Resize", "ResizePolicy", "check_policy", "rescale_lr"]
