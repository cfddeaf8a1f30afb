"""Shared test setup.

Worker functions for multi-process tests live in ``tests/workers/*.py`` and are
named as "workers.module:function"; this puts ``tests/`` on the workers' path.
"""
from __future__ import annotations

import os
import re
import sys

import pytest

TESTS = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(TESTS)  # the harness (``benchmarks.*``) that some workers drive lives outside the package
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (TESTS, REPO, os.environ.get("PYTHONPATH", "")) if p)
if TESTS not in sys.path:
    sys.path.insert(0, TESTS)


@pytest.fixture(autouse=True)
def _plain_process_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """Unit tests run as a plain process: a group of one, whatever the shell exported."""
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    for name in list(os.environ):  # nor pick up servers, timeouts or threads from an outer `phalanx run`
        if name.startswith("PHALANX_"):
            monkeypatch.delenv(name, raising=False)
    # `phalanx run --elastic` forks its workers from a server that imported torch once: 5 s less CPU per worker,
    # most of an elastic test's cost on 2 cores. test_launch_workers checks both start methods.
    monkeypatch.setenv("PHALANX_START_METHOD", "forkserver")


@pytest.fixture(scope="module")
def one_thread():
    """Tiny tensors: extra intra-op threads only contend (and crawl on a loaded machine)."""
    import torch
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# `make test` runs three files at a time (--dist loadfile, --no-loadscope-reorder): each xdist worker takes the next
# file in this order when it is free. The files that start processes go first, the longest of them (measured with
# --durations) at the head, and the unit files last, where they fill whichever worker is free: a long file started
# last would leave the other cores idle while it ran alone.
LONGEST = (  # `make test` with --durations=0, idle, summed per file: 141, 56, 43, 41, 38, 37, 37, 36, 34, 32, 30 s
    "launch/test_ray.py",
    "launch/test_slurm.py",
    "launch/test_launch.py",
    "elastic/test_elastic_sharded.py",
    "ps/test_ps_multiproc.py",
    "monitor/test_status_page.py",
    "bench/test_bench.py",
    "stream/test_stream_multiproc.py",
    "benchmarks/test_quality.py",
    "step/test_preempt.py",
    "elastic/test_elastic.py",
    "elastic/test_elastic_security.py",
    "elastic/test_store_failover.py",
)
STARTS_PROCESSES = re.compile(r"subprocess|run_workers|shared_run|elastic_job|support\.chaos|status_job|Popen")


def _file_order(path: str, cache: dict[str, int]) -> int:
    """0.. for the LONGEST files, then the other files that start processes, then the rest (doctests included)."""
    if path not in cache:
        rel = os.path.relpath(path, TESTS).replace(os.sep, "/")
        if rel in LONGEST:
            cache[path] = LONGEST.index(rel)
        else:
            with open(path, errors="replace") as f:
                cache[path] = len(LONGEST) + (0 if STARTS_PROCESSES.search(f.read()) else 1)
    return cache[path]


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Files in :func:`_file_order` (stable: a file's tests keep their order and stay together)."""
    cache: dict[str, int] = {}
    items.sort(key=lambda item: _file_order(str(item.path), cache))


def needs_root_netns() -> pytest.MarkDecorator:
    """Skip unless we are root with `ip netns` and `tc` available (CI runs as root)."""
    import shutil
    ok = hasattr(os, "geteuid") and os.geteuid() == 0 and shutil.which("ip") and shutil.which("tc")
    return pytest.mark.skipif(not ok, reason="needs root, `ip netns` and `tc` to build a rate-limited veth link")

# A worker written as a module-level script (the point of the test that runs it): importing it would run it,
# so doctest collection leaves it out.
collect_ignore = ["workers/elastic_loop.py", "workers/status_job.py", "workers/stacks.py"]
