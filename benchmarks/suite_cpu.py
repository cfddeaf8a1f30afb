"""Where the test suite's CPU goes: per test file, every process it started, daemons and SIGKILLed workers included.

Two parts, one run:
- ``poll``: samples ``/proc`` every 0.2 s and keeps, for each process whose environment holds ``MARK``, its last
  user+system CPU, argv, xdist worker and ``PYTEST_CURRENT_TEST`` (launchers, fork servers and C++ daemons
  inherit it; a process killed with SIGKILL keeps what it had spent up to its last sample). ``os.times()`` of the
  test process would miss everything not reaped by it.
- ``table`` gives a process to the test its xdist worker was running when the process was first seen: a child of a
  fork server carries the environment the server started with (an earlier test's), not its own.
- the pytest plugin (``-p benchmarks.suite_cpu``): per test, the xdist worker's own CPU and wall, to ``$SUITE_CPU_LOG``.
- ``table``: one row per file: tests, wall, CPU (in the test process + its subprocesses), processes, CPU per process.

Example (the whole suite as ``make test`` runs it; about as long as ``make test``):
    $ export SUITE_CPU_LOG=$PWD/.run/cpu/tests.jsonl; mkdir -p .run/cpu
    $ python -m benchmarks.suite_cpu poll SUITE_CPU_LOG= .run/cpu/procs.jsonl .run/cpu/stop &
    $ python -m pytest -p benchmarks.suite_cpu -n 2 --dist loadfile --no-loadscope-reorder tests src/phalanx
    $ touch .run/cpu/stop; wait; python -m benchmarks.suite_cpu table .run/cpu/tests.jsonl .run/cpu/procs.jsonl
"""
from __future__ import annotations

import bisect
import collections
import json
import os
import sys
import time

import pytest


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):  # noqa: ANN001, ANN201 - pytest's hook signature
    """The test process's own CPU and the wall time of one test (setup, call, teardown)."""
    before, start = os.times(), time.time()
    yield
    after, log = os.times(), os.environ.get("SUITE_CPU_LOG")
    if log:
        with open(log, "a") as f:
            f.write(json.dumps({"test": item.nodeid, "pid": os.getpid(), "start": start, "wall": time.time() - start,
                                "self": after.user + after.system - before.user - before.system}) + "\n")


def poll(mark: str, out: str, stop: str, every_s: float = 0.2) -> None:
    """Sample /proc until the file ``stop`` exists, then write one JSON line per process seen to ``out``."""
    tick, seen, ignored = os.sysconf("SC_CLK_TCK"), {}, set()
    while True:
        done = os.path.exists(stop)
        for d in os.listdir("/proc"):
            if not d.isdigit():
                continue
            try:
                with open(f"/proc/{d}/stat", "rb") as f:
                    fields = f.read().rsplit(b")", 1)[1].split()
                key = (int(d), int(fields[19]))  # pid and start time: a reused pid is another process
                if key in ignored:
                    continue
                if key not in seen:
                    with open(f"/proc/{d}/environ", "rb") as f:
                        raw = f.read()
                    if mark.encode() not in raw:  # not ours: another engineer's process, a shell
                        ignored.add(key)
                        continue
                    env = dict(kv.split(b"=", 1) for kv in raw.split(b"\0") if b"=" in kv)
                    with open(f"/proc/{d}/cmdline", "rb") as f:
                        argv = [a.decode(errors="replace") for a in f.read().split(b"\0")[:6]]
                    seen[key] = {"pid": int(d), "argv": argv, "first": time.time(),
                                 "worker": env.get(b"PYTEST_XDIST_WORKER", b"").decode(),
                                 "test": env.get(b"PYTEST_CURRENT_TEST", b"").decode(errors="replace")}
                seen[key]["cpu"] = (int(fields[11]) + int(fields[12])) / tick
            except OSError:  # gone between listdir and open
                continue
        if done:
            break
        time.sleep(every_s)  # sleep: the sampling period (a process's CPU is read again at the next sample)
    with open(out, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in seen.values())


def table(tests_log: str, procs_log: str, top: int = 30) -> str:
    """The markdown table, files by CPU (in the test process + its subprocesses), most first."""
    tests = [json.loads(line) for line in open(tests_log)]
    procs = [json.loads(line) for line in open(procs_log)]
    pid_of = {t["test"]: t["pid"] for t in tests}
    worker_pid = {p["worker"]: pid_of[p["test"].rsplit(" (", 1)[0]] for p in procs
                  if p["worker"] and p["test"].rsplit(" (", 1)[0] in pid_of}
    spans = collections.defaultdict(list)  # xdist worker pid -> (start, end, test), in order
    for t in tests:
        spans[t["pid"]].append((t["start"], t["start"] + t["wall"], t["test"]))
    for v in spans.values():
        v.sort()

    def running(pid: int | None, when: float) -> str | None:
        v = spans.get(pid, [])
        i = bisect.bisect_right([s for s, _, _ in v], when) - 1
        return v[i][2] if i >= 0 and v[i][0] <= when <= v[i][1] + 0.5 else None

    rows: dict = collections.defaultdict(lambda: {"tests": 0, "wall": 0.0, "self": 0.0, "sub": 0.0, "n": 0})
    for t in tests:
        r = rows[t["test"].split("::")[0]]
        r["tests"] += 1
        r["wall"] += t["wall"]
        r["self"] += t["self"]
    for p in procs:
        if p["pid"] in spans:  # an xdist worker: counted per test above
            continue
        test = running(worker_pid.get(p["worker"]), p["first"]) or p["test"].rsplit(" (", 1)[0]
        if test:
            r = rows[test.split("::")[0]]
            r["sub"] += p["cpu"]
            r["n"] += 1
    lines = ["| file | tests | wall s | CPU s (test process + subprocesses) | processes | CPU s / process |",
             "|---|---|---|---|---|---|"]
    for name, r in sorted(rows.items(), key=lambda kv: -(kv[1]["self"] + kv[1]["sub"]))[:top]:
        per = r["sub"] / r["n"] if r["n"] else 0.0
        lines.append(f"| {name} | {r['tests']} | {r['wall']:.1f} | {r['self'] + r['sub']:.1f} ({r['self']:.1f} + "
                     f"{r['sub']:.1f}) | {r['n']} | {per:.2f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    if sys.argv[1:2] == ["poll"]:
        poll(*sys.argv[2:5])
    elif sys.argv[1:2] == ["table"]:
        print(table(*sys.argv[2:4]))
    else:
        sys.exit("usage: python -m benchmarks.suite_cpu poll MARK OUT STOP | table TESTS_LOG PROCS_LOG")
