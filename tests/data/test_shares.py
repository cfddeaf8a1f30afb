"""LocalSGD and DiLoCo weight each replica by the samples it trained since the last average (issue 20 item 11).

With plain SGD and every=1 both are AllReduce, hence one process on the global batch, also
when the last global batch splits unevenly (13 samples: ... 3 / 2) or leaves a worker an
empty part (9 samples: ... 1 / 0), where an equal average would halve the other's update.
"""
from __future__ import annotations

import pytest

from support.procs import run_workers

SIZES = [13, 9]
NAMES = ["allreduce", "local-sgd", "diloco"]


@pytest.fixture(scope="module")
def runs() -> list[dict]:
    return run_workers("workers.shares:shares", world_size=2, timeout=180, sizes=SIZES, names=NAMES).results


@pytest.mark.multiproc
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("name", NAMES)
def test_every_one_averages_like_one_process_on_uneven_and_empty_parts(runs, name, n):
    for rank in (0, 1):
        assert (runs[rank][f"{name} {n}"] - runs[rank][f"oracle {n}"]).abs().max().item() < 1e-6
