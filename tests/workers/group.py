"""Worker functions for the Group tests in tests/test_core.py: each runs in every rank of a real gloo group."""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

import phalanx as px
from phalanx.group import collectives as comm, transfer
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


def _state(n_big: int) -> dict[str, Any]:
    """A commit-shaped state: tensors of several dtypes and sizes (one larger than a chunk), plain values, nesting."""
    from collections import OrderedDict
    gen = torch.Generator().manual_seed(7)
    big = torch.randn(n_big, generator=gen)
    return {"model": OrderedDict([("w", big), ("b", torch.randn(3, generator=gen)),
                                  ("half", torch.randn(5, 7, generator=gen).to(torch.bfloat16))]),
            "optimizer": {"state": {0: {"step": torch.tensor(4.0), "exp_avg": torch.randn(300, generator=gen)}},
                          "param_groups": [{"lr": 0.1, "params": [0]}]},
            "mask": torch.tensor([True, False, True]), "empty": torch.empty(0, 4), "count": torch.tensor(9),
            "strided": torch.arange(12.0).reshape(3, 4).t(), "pair": (torch.ones(2, dtype=torch.int32), "x"),
            "step": 5, "name": "newest", "none": None}


def streamed_state(n_big: int = 5000, chunk_bytes: int = 1000) -> dict[str, Any]:
    """Rank 1 streams a state to rank 0 in chunks smaller than its largest tensor; each returns what it holds."""
    g = px.init()
    got = transfer.broadcast_state(_state(n_big) if g.rank == 1 else None, src=1, chunk_bytes=chunk_bytes)
    return {"got": got, "expected": _state(n_big)}


def _peak_kib() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))


def streamed_state_memory(mib: int = 64, chunk_bytes: int = 1 << 20, streamed: bool = True) -> dict[str, Any]:
    """Rank 0 sends ``mib`` MiB of tensors; each rank's peak RSS growth during the broadcast, in bytes."""
    g = px.init()
    # 4 tensors of mib/4 MiB behind a small one, so the chunks do not fall on tensor boundaries
    state = {"small": torch.ones(3), "t": [torch.randn(mib << 16) for _ in range(4)]} if g.rank == 0 else None
    freed = torch.ones(40 << 18)  # 40 MiB freed: glibc then serves (and keeps) blocks of up to 40 MiB from its heap,
    del freed  # as after a worker drops its live model for the commit's copy
    comm.broadcast_object(torch.ones(1), src=0)  # the group's connections made before the baseline
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the peak RSS starts again from the present RSS
    base = _peak_kib()
    got = transfer.broadcast_state(state, src=0, chunk_bytes=chunk_bytes) if streamed else \
        comm.broadcast_object(state, src=0)
    grown = (_peak_kib() - base) << 10
    return {"grown": grown, "numel": sum(t.numel() for t in got["t"])}
