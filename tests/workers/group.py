"""Worker functions for the Group tests in tests/test_core.py: each runs in every rank of a real gloo group."""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

import phalanx as px
from phalanx.group import collectives as comm
from phalanx.group import liveness
from support.wait import until


def rebuild_and_objects() -> dict[str, Any]:
    """Objects through collectives, then a rebuild into generation 1 with the ranks swapped, then again."""
    g = px.init()
    seen: list[tuple[int, int, int]] = []
    g.on_regroup(lambda grp: seen.append((grp.rank, grp.world_size, grp.generation)))
    out: dict[str, Any] = {
        "init_is_current": g is px.current_group(),
        "all": comm.all_gather_object({"rank": g.rank, "t": torch.arange(g.rank + 1)}),
        "gather": comm.gather_object([g.rank] * (g.rank + 3), dst=1),
        "bcast": comm.broadcast_object({"from": g.rank, "t": torch.ones(2) * g.rank} if g.rank == 1 else None, src=1),
        "rank_before": g.rank,
    }
    store = dist.PrefixStore("test/generation/1", g.job_store)
    g.rebuild(1 - g.rank, 2, store, generation=1)
    t = torch.tensor([float(g.rank + 1)])
    px.Comm().all_reduce_([t], op="sum")
    out.update(rank_after=g.rank, module_rank=px.rank(), generation=g.generation, seen=list(seen),
               sum_after=float(t.item()), all_after=comm.all_gather_object(g.rank),
               beats_after=liveness.beats(store, 2))
    return out


def note_then_wait() -> dict[str, Any]:
    """Rank 1 raises (its exit note says so); rank 0 asks lost_peers() until it names rank 1, with no collective."""
    g = px.init()
    px.barrier()
    if g.rank == 1:
        raise ValueError("boom")
    before = g.lost_peers()
    until(g.lost_peers, timeout=30, what="rank 1 seen lost")
    return {"before": before, "after": g.lost_peers()}
