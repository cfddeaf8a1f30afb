"""px.shard(balance="speed"): the global batch split by the workers' measured throughput (issue 24 item 4).

The split changes mid-epoch (speeds injected through a speed source, every 2 steps), yet each
step's global batch is the contiguous slice one process takes, every sample is trained once per
epoch, the result equals one process on the same global batches, and a resumed loader goes on
with the same split.
"""
from __future__ import annotations

import pytest
import torch

import phalanx as px
from phalanx.data.loader import SpeedBalance, global_batches, shares_from, split_sizes
from phalanx.errors import ConfigError
from support.procs import run_workers

EPOCHS, STOP_AT = 2, 8


@pytest.fixture(scope="module")
def runs() -> list[dict]:
    return run_workers("workers.balance:balanced", world_size=2, timeout=180, epochs=EPOCHS, stop_at=STOP_AT).results


def _steps(run: dict, key: str = "seen") -> list[tuple[int, list[int]]]:
    return [(e, idx) for e, idx in run[key]]


@pytest.mark.multiproc
def test_split_follows_speed_and_each_step_is_one_process_global_batch(runs):
    r0, r1 = _steps(runs[0]), _steps(runs[1])
    oracle = _steps(runs[0], "oracle_seen")
    assert len(r0) == len(r1) == len(oracle)  # as many steps as one process
    sizes = [(len(a), len(b)) for (_, a), (_, b) in zip(r0, r1)]
    # equal until measured; then 1:3 s/sample (6 and 2 of 8), 1:1, 2:1 (3 and 5), ... every 2 steps, across epochs;
    # a short last global batch (4 samples) is cut by the same shares
    assert sizes == [(4, 4), (4, 4), (6, 2), (6, 2), (4, 4), (2, 2),
                     (3, 5), (3, 5), (6, 2), (6, 2), (4, 4), (2, 2)], sizes
    for (e, a), (_, b), (eo, batch) in zip(r0, r1, oracle):
        assert e == eo and a + b == batch  # rank 0's part, then rank 1's: the contiguous global batch
    for epoch in range(EPOCHS):
        trained = sorted(i for (e, a), (_, b) in zip(r0, r1) if e == epoch for i in a + b)
        assert trained == list(range(44))  # every sample exactly once per epoch


@pytest.mark.multiproc
def test_balanced_training_equals_one_process(runs):
    for run in runs:
        assert (run["params"] - run["oracle"]).abs().max().item() < 1e-5
    assert torch.equal(runs[0]["params"], runs[1]["params"])


@pytest.mark.multiproc
def test_resumed_loader_keeps_the_split(runs):
    assert runs[0]["saved_shares"] is not None and runs[0]["saved_shares"] != [0.5, 0.5]
    for run in runs:
        assert run["resumed_seen"] == run["seen"]
        assert (run["resumed_params"] - run["params"]).abs().max().item() < 1e-6


def test_split_sizes_and_shares():
    assert split_sizes(8, [0.25, 0.75]) == [2, 6]
    assert split_sizes(8, [0.5, 0.5]) == [4, 4]
    assert split_sizes(3, [0.999, 0.001]) == [2, 1]  # every worker keeps a sample, so it is measured again
    assert shares_from([1.0, 3.0]) == [0.75, 0.25]
    assert shares_from([1.0, 0.0]) is None  # an unusable measurement keeps the current split
    plan = global_batches(10, 2, 2, shuffle=False, seed=0, epoch=0, shares=[0.75, 0.25])
    assert plan == [[[0, 1, 2], [3]], [[4, 5, 6], [7]], [[8], [9]]]  # the short last batch (2 < 4) splits evenly
    b = SpeedBalance(every=2, speed=lambda n, s: s / n)
    b.handed_out(4)
    b.worked(1.0)
    assert not b.due
    b.handed_out(4)
    b.worked(1.0)
    assert b.due and b.measure() == 0.25 and b.since == 0


def test_bad_balance_arguments_are_one_line():
    data = torch.utils.data.TensorDataset(torch.randn(8, 2))
    with pytest.raises(ConfigError, match="balance='speed' or None"):
        px.shard(data, batch_size=2, balance="fast")
    with pytest.raises(ConfigError, match="rebalance_every"):
        px.shard(data, batch_size=2, balance="speed", rebalance_every=0)
    with pytest.raises(ConfigError, match="without balance"):
        px.shard(data, batch_size=2, rebalance_every=10)
    with pytest.raises(ConfigError, match="a function"):
        px.shard(data, batch_size=2, balance="speed", speed=0.5)


@pytest.mark.parametrize("strategy", [lambda: px.EASGD(every=2),
                                      lambda: px.Periodic(px.every(2), px.ParameterAverage())])
def test_balance_refuses_strategies_that_count_workers_alike(strategy):
    px.init()
    try:
        net = torch.nn.Linear(2, 1)
        px.wrap(net, torch.optim.SGD(net.parameters(), lr=0.1), strategy=strategy())
        with pytest.raises(ConfigError, match="weights each worker by its share"):
            px.shard(torch.utils.data.TensorDataset(torch.randn(8, 2)), batch_size=2, balance="speed")
    finally:
        px.shutdown()


def test_balance_refused_when_the_model_is_wrapped_after_the_loader():
    px.init()
    try:
        loader = px.shard(torch.utils.data.TensorDataset(torch.randn(8, 2)), batch_size=2, balance="speed")
        net = torch.nn.Linear(2, 1)
        px.wrap(net, torch.optim.SGD(net.parameters(), lr=0.1), strategy=px.EASGD(every=2))
        with pytest.raises(ConfigError, match="EASGD"):
            next(iter(loader))
    finally:
        px.shutdown()


def test_split_returns_to_equal_after_a_regroup_or_a_resize():
    loader = px.shard(torch.utils.data.TensorDataset(torch.arange(16.)), batch_size=4, shuffle=False, balance="speed",
                      rank=0, world_size=2)
    state = {**loader.state_dict(), "balance": {"shares": [0.75, 0.25], "since": 3, "generation": 0}}
    loader.load_state_dict(state)  # the same group: resume exact
    assert loader.sampler.shares == [0.75, 0.25] and loader.balance.since == 3
    assert [len(p) for p in loader.sampler.plan()[0]] == [6, 2]
    loader.sampler.world_size = 3  # phalanx.elastic re-split the rest of the epoch over 3 workers
    assert [len(p) for p in loader.sampler.plan()[0]] == [4, 4, 4]
    loader.sampler.world_size = 2
    loader.load_state_dict({**state, "balance": {**state["balance"], "generation": 1}})  # taken in another group
    assert loader.sampler.shares is None and loader.balance.since == 0
    assert [len(p) for p in loader.sampler.plan()[0]] == [4, 4]
