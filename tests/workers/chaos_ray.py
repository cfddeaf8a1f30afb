"""The chaos soak's job on Ray: ``python tests/workers/chaos_ray.py --out DIR [chaos_job flags]``.

It starts a Ray cluster on this machine (one node, one CPU per worker and one spare CPU, no
dashboard, Ray's memory monitor off: the harness places its own kills) and runs
``tests/workers/chaos_job.py``'s job on ``--workers`` Ray Train workers through
``phalanx.launch.raytrain.train`` (min_workers=1, no limit on the failures Ray replaces). The
harness (``tests/support/chaos.py``) kills the worker actors' processes by the pids their
event files name, as it kills ``phalanx run``'s workers; Ray replaces each lost actor and the
replacement joins at the next commit with rank 0's state. It prints one line when Ray is up
(the harness waits for it) and one with rank 0's result when the job ends.
"""
from __future__ import annotations

import argparse
import faulthandler
import os
import signal
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--workers", type=int, default=3)
    p.add_argument("--heartbeat-timeout", type=float, default=10.0)
    a, job = p.parse_known_args()
    faulthandler.register(signal.SIGUSR2, all_threads=True)  # the harness asks every process for its stacks
    os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.5")  # Ray's controller polls its workers this often
    os.environ.setdefault("RAY_memory_monitor_refresh_ms", "0")  # a loaded shared machine: no kills we did not place
    import ray

    from phalanx.launch.raytrain import train
    from workers import chaos_job

    tests = os.path.dirname(HERE)
    ray.init(num_cpus=a.workers + 1, include_dashboard=False, object_store_memory=200 * 1024 ** 2,
             runtime_env={"env_vars": {"PYTHONPATH": os.pathsep.join([tests, os.environ.get("PYTHONPATH", "")])}},
             log_to_driver=True)
    print("phalanx: chaos: ray is up; its store is at (the Ray Train controller)", flush=True)
    try:
        result = train(chaos_job.main, job, num_workers=a.workers, min_workers=1, max_failures=-1,
                       heartbeat_s=a.heartbeat_timeout)
    finally:
        print("phalanx: chaos: ray job over", flush=True)
    print(f"phalanx: chaos: rank 0 returned {result}", flush=True)
    ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(HERE))  # tests/: `workers.chaos_job` and `support.*` import
    sys.exit(main())
