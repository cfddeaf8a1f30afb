"""Rebuild the worker group in-process, without the lost workers (or with the joiners).

The mechanics live on the group itself (:meth:`phalanx.group.group.Group.rebuild`, which forms
the process group on these keys alone: :mod:`phalanx.group.forming`); this module only names
each generation's key space: a ``PrefixStore`` of the launcher's store, so no key of a dead
generation is ever read again, and a failed attempt leaves nothing a later one could meet.
The launcher's store outlives every worker, rank 0 included.

Example:
    >>> generation_prefix(3)
    'phalanx/elastic/3'
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch.distributed as dist

from ..group import group, leaving
from ..group.leaving import release  # noqa: F401 (used by tests)


def destroy() -> None:
    """Leave the current generation's process groups (peers blocked on our sockets fail at once)."""
    if group.is_initialized():
        group.current().drop_process_groups()
    else:
        leaving.destroy_process_group()


def generation_prefix(generation: int) -> str:
    return f"phalanx/elastic/{generation}"


def rebuild(base_store: dist.Store, generation: int, rank: int, world_size: int, *, timeout_s: float | None = None,
            backend: str | None = None, lost: Callable[[], Sequence[int]] | None = None) -> None:
    """Form generation ``generation``'s group on its own key space of ``base_store`` (collective across members).

    ``lost()`` names the ranks of the new generation known dead (the launcher's dead marks):
    forming stops waiting for them at once, and any failure to form is a
    :class:`~phalanx.errors.WorkerLostError` (one more regroup). ``timeout_s`` is ignored: the
    group keeps its own bound (``px.init(timeout=...)``).
    """
    store = dist.PrefixStore(generation_prefix(generation), base_store)
    # init() returns the current group (a joiner that skipped px.init() gets one here, kept as the current one)
    group.init().rebuild(rank, world_size, store, generation=generation, job_store=base_store, backend=backend,
                         lost=lost)
