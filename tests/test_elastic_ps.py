"""Parameter servers under ``phalanx run --elastic``: real workers, real server processes, real kills.

The synchronous PS averages each step's gradients on the servers, so a worker that dies
leaves the others waiting on a server, not in a gloo collective: they must notice the
death (the launcher marks it), abandon the round, regroup, and have the servers key the
redone steps' rounds with the new group and its worker count. The checks are the ones
of tests/test_elastic.py: same processes, exit 0, every sample once per epoch, and the
final model equal to one process trained on the same global batches.
"""
from __future__ import annotations

import pytest
from test_elastic import check_recovered, launch

pytestmark = pytest.mark.multiproc


@pytest.mark.parametrize("servers", [["--servers", "1"], []], ids=["separate", "colocated"])
def test_sync_ps_survives_killing_one_of_three_workers_and_matches_the_oracle(tmp_path, servers):
    proc, results = launch(tmp_path, "--min-workers", "2", *servers, "--", "--kill", "1@5", "--kill-in-step",
                           "--commit-every", "3",
                           "--strategy", "ps-sync")
    seconds = check_recovered(tmp_path, proc, results, "1", 5)["kill_to_first_step_s"]
    assert seconds < 10, seconds  # the survivors left the server's round at once; its timeout is 30 s
