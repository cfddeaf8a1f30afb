"""Leaving a process group (phalanx.group.leaving.destroy_process_group): the old groups are freed at once (their
sockets close, so a peer blocked on us fails now), by the cheapest collection that frees them.

Real gloo groups of one process; the failure's reference cycles are built by hand, young or old.
"""
from __future__ import annotations

import gc
import weakref

import pytest
import torch.distributed as dist

from phalanx.group import leaving


@pytest.fixture
def collections(monkeypatch):
    """Every gc.collect() the code under test makes, by generation (2: a full collection), automatic ones off."""
    calls: list[int] = []
    real = gc.collect

    def collect(generation: int = 2) -> int:
        calls.append(generation)
        return real(generation)

    monkeypatch.setattr(gc, "collect", collect)
    enabled = gc.isenabled()
    gc.disable()  # an automatic collection in between would age the cycles below: the test says how old they are
    yield calls
    if enabled:
        gc.enable()
    if dist.is_initialized():
        dist.destroy_process_group()


def test_a_group_held_by_the_failures_young_cycle_is_freed_without_a_full_collection(collections) -> None:
    # issue 36: a full collection walks every object of a process that imported torch (300,000): 0.23-0.96 s of
    # every regroup on each survivor at load 10. The failed collective's cycle is young: one of generation 1 frees it.
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    pg = weakref.ref(dist.group.WORLD)
    cycle: dict = {"group": dist.group.WORLD}
    cycle["self"] = cycle  # the exception -> traceback -> frame -> locals -> exception of a failed collective
    del cycle
    leaving.destroy_process_group()
    assert pg() is None, "the old group outlived its destruction: its sockets stay open"
    assert 2 not in collections, f"collections made: {collections} (2 is a full one)"


def test_a_subgroup_held_by_an_old_cycle_is_still_freed_by_a_full_collection(collections) -> None:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    sub = dist.new_group([0])
    cycle: dict = {"group": sub}
    cycle["self"] = cycle
    gc.collect()
    gc.collect()  # survived two collections: in the oldest generation, out of a young collection's reach
    ref = weakref.ref(sub)
    del cycle, sub
    collections.clear()
    leaving.destroy_process_group(also=[ref])
    assert ref() is None and 2 in collections, collections


def test_a_saves_handle_does_not_keep_its_generations_checkpoint_group_alive(collections, tmp_path) -> None:
    # issue 36: the last save's handle (kept per group to reuse its checkpoint group within a generation) held the
    # previous generation's group after a regroup: its sockets to every old peer stayed open until the next save,
    # and the regroup's full collection ran for nothing. The group's own cache keeps it within a generation.
    from phalanx.checkpoint.handle import SaveHandle

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    pg = dist.new_group([0])
    handle = SaveHandle(str(tmp_path / "ckpt"), None, None, 0, pg=pg, generation=3)
    assert handle.pg is pg and handle.generation == 3  # reused by the next save of generation 3
    ref = weakref.ref(pg)
    del pg
    leaving.destroy_process_group(also=[ref])
    assert ref() is None and handle.pg is None
    assert 2 not in collections, f"collections made: {collections} (2 is a full one)"
