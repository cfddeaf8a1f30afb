"""AllReduce's overlapped bucketed average (no DDP wrapper), as under ``phalanx run --elastic`` and for Keras.

Unit tests check the bucket plan and a group of one; the multi-process tests compare 2 real
gloo workers with batch b against one plain process with batch 2b (SGD + momentum, gradient
clipping, an uneven last batch, a parameter some batches do not reach, one no batch reaches,
gradient accumulation under ``px.no_sync``).
"""
from __future__ import annotations

import pytest
import torch

import phalanx as px
from phalanx.group.collectives import Comm
from phalanx.strategies.overlap import OverlappedMean, plan_buckets
from support.procs import run_workers
from workers.overlap import B, dataset, flat, net, train

# 45: the last global batch of 5 splits 3 / 2 (batch weights); accumulating 2 micro-batches, the last step's second
# micro-batch is that short one, so its weight differs from the first's
EPOCHS, N_PLAIN, N_ACCUMULATE = 2, 45, 45


def test_buckets_follow_reverse_registration_order_and_size() -> None:
    params = [torch.nn.Parameter(torch.zeros(n)) for n in (100, 100, 100, 10)]
    buckets = plan_buckets(params, bucket_bytes=800)  # 200 floats
    assert [[p.numel() for p in b.params] for b in buckets] == [[10, 100, 100], [100]]
    assert buckets[0].params[0] is params[3]
    half = [torch.nn.Parameter(torch.zeros(3, dtype=torch.float16)), torch.nn.Parameter(torch.zeros(3))]
    assert [b.flat.dtype for b in plan_buckets(half, 2**20)] == [torch.float32, torch.float16]


def test_a_group_of_one_leaves_the_gradient_and_a_missing_one_none() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    unused = torch.nn.Parameter(torch.ones(2))
    mean = OverlappedMean([*model.parameters(), unused], Comm(), bucket_bytes=32)
    x = torch.randn(5, 3)
    model(x).pow(2).sum().backward()
    local = [p.grad.clone() for p in model.parameters()]
    mean.finish()
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), local, strict=True))
    assert unused.grad is None  # reached by no rank: the optimizer skips it, as in one process
    for p in model.parameters():  # the next pass accumulates into the bucket views in place
        p.grad.zero_()
    model(x).pow(2).sum().backward()
    mean.finish()
    assert all(torch.allclose(p.grad, g) for p, g in zip(model.parameters(), local, strict=True))
    mean.remove()


@pytest.fixture(scope="module")
def two() -> list[dict]:
    return run_workers("workers.overlap:everything", world_size=2, timeout=120,
                       n_plain=N_PLAIN, n_accumulate=N_ACCUMULATE, epochs=EPOCHS).results


def _oracle(seed: int, n: int, shuffle_seed: int, accumulate: int = 1) -> torch.Tensor:
    model = net(seed)  # rank 0's seed: px.wrap gave every worker rank 0's weights
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    train(model, opt, px.shard(dataset(n), batch_size=2 * B, shuffle=True, seed=shuffle_seed, rank=0, world_size=1),
          EPOCHS, accumulate=accumulate)
    return flat(model)


@pytest.mark.multiproc
def test_two_workers_equal_one_process_with_clipping_uneven_batches_and_unused_parameters(two: list[dict]) -> None:
    assert not two[0]["ddp"] and two[0]["buckets"] >= 3, two[0]  # the hooks, not DDP, in several buckets
    oracle = _oracle(10, N_PLAIN, 3)
    for rank in (0, 1):
        assert (two[rank]["plain"] - oracle).abs().max().item() < 1e-5
        assert all(two[rank]["plain_agree"]) and len(two[rank]["plain_agree"]) == EPOCHS * 6
    assert two[0]["bytes_per_step"] > 0 and two[0]["never_grad"] is None and two[1]["never_grad"] is None


@pytest.mark.multiproc
def test_no_sync_accumulation_equals_one_process_accumulating(two: list[dict]) -> None:
    oracle = _oracle(20, N_ACCUMULATE, 4, accumulate=2)
    for rank in (0, 1):
        assert (two[rank]["accumulate"] - oracle).abs().max().item() < 1e-5
        assert two[rank]["accumulate_steps"] == EPOCHS * 3  # one step per 2 micro-batches
        assert all(two[rank]["accumulate_agree"])


@pytest.mark.multiproc
def test_a_dead_worker_is_named_by_the_overlapped_average() -> None:
    timeout = 10
    run = run_workers("workers.overlap:lost_worker", world_size=2, check=False, timeout=60,
                      env={"PHALANX_TIMEOUT": str(timeout)})
    assert run.returncodes[1] == 3
    seen = run.results[0]
    assert seen["type"] == "WorkerLostError", seen
    assert "lost contact with rank(s) 1" in seen["message"]
    assert "gradient all-reduce in backward" in seen["message"]
    assert seen["seconds"] < timeout
