"""Rebuild the worker group in-process, without the lost workers.

gloo's group cannot shrink: we destroy it and create a fresh one for the new
generation on a ``PrefixStore`` of the launcher's store (each generation its own
key space, so no key of a dead generation is ever read again). The launcher's store
outlives every worker, rank 0 included.

Destroying the old group first matters: a survivor blocked in a collective with the
dead peer's neighbours sees its sockets close and fails at once instead of waiting
for the collective timeout.

Example:
    >>> generation_prefix(3)
    'phalanx/elastic/3'
"""
from __future__ import annotations

import gc
import sys
import warnings
from datetime import timedelta

import torch.distributed as dist

from .. import group


def generation_prefix(generation: int) -> str:
    return f"phalanx/elastic/{generation}"


def destroy() -> None:
    """Drop the current process group; errors from a group whose peers died are expected."""
    if not dist.is_initialized():
        return
    release(dist.group.WORLD)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - a broken group may fail to tear down; it is gone either way
            pass
    # The failed collective's exception and traceback form reference cycles that hold the old group's
    # work objects, and through them the group; its sockets close only when it is freed. Until the next
    # automatic collection (seconds later, or never in a quiet loop) a peer blocked on us waits for its
    # collective timeout (seen on torch 2.11: 4 workers, every recovery missed the quorum).
    gc.collect()


def release(pg: object) -> int:
    """Drop the references to ``pg`` that outlive ``destroy_process_group``; returns how many were dropped.

    gloo closes a group's sockets only when the group object dies. While it lives, a
    survivor blocked in a collective on us (not on the dead worker: with 4 workers,
    rank 0 when rank 2 dies) waits for its collective timeout instead of failing at once.
    ``torch.distributed.nn.functional`` binds ``group.WORLD`` as a default argument when it
    is first imported (torch imports it lazily, e.g. on the first ``px.wrap``); a default
    of None means the same group there, the default one.

    Example:
        >>> release(object())
        0
    """
    module = sys.modules.get("torch.distributed.nn.functional")
    dropped = 0
    for fn in list(vars(module).values()) if module is not None else []:
        defaults = getattr(fn, "__defaults__", None)
        if defaults and any(d is pg for d in defaults):
            fn.__defaults__ = tuple(None if d is pg else d for d in defaults)
            dropped += 1
    return dropped


def rebuild(base_store: dist.Store, generation: int, rank: int, world_size: int, *, timeout_s: float,
            backend: str = "gloo") -> None:
    """Create generation ``generation``'s group and point phalanx's group at it."""
    destroy()
    store = dist.PrefixStore(generation_prefix(generation), base_store)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=timeout_s))
    group.regroup(rank, world_size, store)
