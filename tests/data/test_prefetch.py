"""Device prefetch on CPU: a no-op that changes nothing (the GPU side is in tests/test_gpu.py)."""
from __future__ import annotations

from collections import namedtuple

import torch

import phalanx as px
from phalanx.data.prefetch import DevicePrefetcher, prefetch, to_device


def test_on_cpu_prefetch_is_the_loaders_own_iterator():
    batches = [torch.ones(1)]
    it = iter(batches)
    assert prefetch(it, "cpu") is iter(it)  # nothing wrapped: costs nothing
    assert prefetch(it, None) is iter(it)


def test_shard_with_a_cpu_device_gives_the_same_batches_in_the_same_order():
    data = torch.utils.data.TensorDataset(torch.randn(37, 3), torch.arange(37))
    for epoch in (0, 1):
        a = px.shard(data, batch_size=5, seed=2, rank=1, world_size=2)
        b = px.shard(data, batch_size=5, seed=2, rank=1, world_size=2, device="cpu")
        a.set_epoch(epoch), b.set_epoch(epoch)
        got, ref = list(b), list(a)
        assert len(got) == len(ref) == 4
        assert all(torch.equal(x, rx) and torch.equal(y, ry) for (x, y), (rx, ry) in zip(got, ref))


def test_to_device_keeps_the_batch_structure():
    Pair = namedtuple("Pair", "x y")
    batch = {"a": Pair(torch.ones(2), [torch.zeros(1), "tag"]), "n": 3}
    moved = to_device(batch, torch.device("cpu"))
    assert isinstance(moved["a"], Pair) and moved["a"].y[1] == "tag" and moved["n"] == 3
    assert torch.equal(moved["a"].x, torch.ones(2))


def test_device_prefetcher_passes_the_loader_through():
    loader = px.shard(torch.utils.data.TensorDataset(torch.arange(8.0)), batch_size=2, rank=0, world_size=1)
    wrapped = DevicePrefetcher(loader, "cpu")
    wrapped.set_epoch(1)
    assert len(wrapped) == 4 and loader.sampler.epoch == 1
    assert sorted(torch.cat([b[0] for b in wrapped]).tolist()) == [float(i) for i in range(8)]
