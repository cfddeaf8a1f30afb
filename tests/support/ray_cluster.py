"""The Ray cluster the Ray tests share: a head and two worker nodes on this machine, one CPU each.

Bind the fixture in a test module (``cluster = ray_cluster.cluster``); it is module-scoped, as Ray takes seconds
to start. Ray's controller polls its workers every 0.5 s, so a loss is seen at once.
"""
from __future__ import annotations

import signal

import pytest


@pytest.fixture(scope="module")
def cluster():
    """A head and two worker nodes, one CPU each: Ray places one phalanx worker per node."""
    import ray
    from ray.cluster_utils import Cluster

    mp = pytest.MonkeyPatch()
    mp.setenv("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.5")  # Ray's controller polls its workers this often
    # Ray's memory monitor kills workers when the *machine* is above 95% of its memory: on a shared test machine
    # that is other processes' doing, and a kill the test did not place. The tests place their own kills.
    mp.setenv("RAY_memory_monitor_refresh_ms", "0")
    # Ray starts its workers at nice 15: beside any process at nice 0 (the other xdist worker's tests, the busy loops
    # of benchmarks/busy_loops.sh) an actor's start-up got a few percent of a core (a Ray Train run took minutes).
    # The tests' other processes run at 0; so do Ray's here.
    mp.setenv("RAY_worker_niceness", "0")
    # Ray prestarts an idle worker process when the first driver connects; every process here is an actor (its own
    # process, started for it), so that one only cost a start.
    mp.setenv("RAY_prestart_worker_first_driver", "0")
    small = {"num_cpus": 1, "object_store_memory": 80 * 1024 ** 2, "include_dashboard": False}
    # ray.init installs its own SIGTERM handler in the driver (sys.exit(15)) and ray.shutdown leaves it: a later
    # test in this xdist worker that signals itself (test_preempt's in-process Trainer) then got SystemExit(15).
    handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    c = Cluster(initialize_head=True, head_node_args=dict(small))
    for _ in range(2):
        c.add_node(**small)
    ray.init(address=c.address, log_to_driver=True)
    yield c
    ray.shutdown()
    c.shutdown()
    mp.undo()
    for s, handler in handlers.items():
        signal.signal(s, handler)

