"""Gradient accumulation with a short micro-batch equals one process on the same samples (2 real workers).

Each micro-batch's gradient counts by its own share of its global batch, whatever the
others' shares are (issue 20, item 9: the whole sum used to take the last one's weight).
"""
from __future__ import annotations

import pytest

from support.procs import shared_run

NAMES = ["allreduce", "topk1", "local-warmup"]


runs = shared_run("workers.accumulation:uneven", timeout=180, names=NAMES)


@pytest.mark.multiproc
@pytest.mark.parametrize("name", NAMES)
def test_uneven_micro_batches_accumulate_to_one_process_gradient(runs, name):
    for rank in (0, 1):
        assert (runs[rank][name] - runs[rank]["oracle"]).abs().max().item() < 1e-6
