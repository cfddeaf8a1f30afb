"""BatchNorm's running statistics under periodic rules: averaged with the parameters, at the same syncs.

Without it each replica keeps the statistics of its own data and weights, and the model kept at the end (and
every evaluation after an outer step) pairs averaged weights with one replica's statistics. Oracle: the mean of
both ranks' statistics at a sync step (gathered before the step), each rank's own between syncs.
"""
from __future__ import annotations

import pytest
import torch

from support.procs import run_workers
from workers.running_stats import STEPS

pytestmark = pytest.mark.multiproc


@pytest.fixture(scope="module")
def results():
    (r0, r1) = run_workers("workers.running_stats:run", world_size=2, timeout=240).results
    return r0, r1


def sync_steps(make: str, got: dict) -> set[int]:
    if make == "streaming":  # the BN layer's parameters are in the second fragment, offset H * 1 // P = 2
        assert got["fragment_of_bn"] == [(1, 2)]
        return {s for s in range(1, STEPS + 1) if s % 4 == 2}
    return {3, 6, 9}


@pytest.mark.parametrize("make", ["local-sgd", "diloco", "easgd", "streaming"])
def test_running_statistics_are_averaged_at_each_sync_and_kept_between(results, make):
    syncs = sync_steps(make, results[0][make])
    for rank in (0, 1):
        for row in results[rank][make]["rows"]:
            mine = row["before"][rank]
            if row["step"] in syncs:
                want = [(a + b) / 2 for a, b in zip(*row["before"], strict=True)]
                assert not all(torch.equal(a, b) for a, b in zip(*row["before"], strict=True))  # they did differ
            else:
                want = mine
            for got, expected in zip(row["after"], want, strict=True):
                torch.testing.assert_close(got, expected, rtol=0, atol=1e-6, msg=f"{make} rank {rank} {row['step']}")


@pytest.mark.parametrize("make", ["local-sgd", "diloco", "easgd", "streaming"])
def test_the_model_kept_at_the_end_has_one_set_of_statistics(results, make):
    a, b = results[0][make]["final"]
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def test_a_buffer_no_step_changes_costs_a_flag_not_its_bytes(results):
    # 3 syncs of LocalSGD(every=3) in 9 steps; the 1000-float mask adds one 4-byte flag to each
    with_mask, without = results[0]["local-sgd"]["bytes"], results[0]["local-sgd-without-constant"]["bytes"]
    assert with_mask - without == 3 * 4
