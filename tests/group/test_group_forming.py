"""Forming a process group phalanx owns (phalanx.group.forming): bounded, watching the lost, all or nothing.

Real gloo over a real store, ranks in threads of one process (no peer process to start).
"""
from __future__ import annotations

import threading
import time

import pytest
import torch
import torch.distributed as dist

from phalanx.errors import WorkerLostError
from phalanx.group import forming


def form_all(store: dist.Store, world: int, lost=lambda: []) -> list:
    """Every rank of a group of ``world`` forms it from its own thread; each rank's backend or exception."""
    out: list = [None] * world

    def one(rank: int) -> None:
        try:
            out[rank] = forming.form(store, rank, world, timeout_s=30.0, lost=lost)
        except Exception as err:  # noqa: BLE001 - the test looks at it
            out[rank] = err

    threads = [threading.Thread(target=one, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return out


def test_every_rank_forms_a_working_group_on_the_keys_it_is_given():
    store = dist.PrefixStore("phalanx/elastic/7", dist.HashStore())
    backends = form_all(store, 3)
    assert [b.size() for b in backends] == [3, 3, 3] and store.get("form/verdict") == b"ok"
    tensors = [torch.full((2,), float(r + 1)) for r in range(3)]
    works = [b.allreduce([t]) for b, t in zip(backends, tensors, strict=True)]
    for w in works:
        w.wait()
    assert all(t.tolist() == [6.0, 6.0] for t in tensors)


def test_a_member_known_lost_ends_the_wait_at_once_as_a_lost_peer():
    store = dist.HashStore()
    started = time.monotonic()
    with pytest.raises(WorkerLostError) as caught:
        forming.form(store, 0, 2, timeout_s=300.0, lost=lambda: [1])  # rank 1 never comes: it is marked dead
    assert time.monotonic() - started < 10 and caught.value.lost_ranks == [1]
    assert store.get("form/verdict") == b"no"  # and nobody else keeps a group that formed without it


def test_a_group_that_failed_on_one_rank_fails_on_every_rank():
    store = dist.HashStore()
    store.set("form/verdict", "no")  # one rank could not connect and said so first
    backends = form_all(store, 2)
    assert all(isinstance(b, WorkerLostError) for b in backends), backends
