"""How fast phalanx notices a failure, and whether it ever blames a live rank.

Run from the repository root (each trial starts real processes; about 10 s a trial on an
idle 2-core machine, several times that on a busy one):

    python benchmarks/failure_detection.py                   # everything, 10 trials of the blame check
    python benchmarks/failure_detection.py --only blame --trials 10
    python benchmarks/failure_detection.py --only raise,kill,ctrl-c,hung --trials 5
    python benchmarks/failure_detection.py --only orphans --trials 5

What it measures (medians over trials, wall clock):
- raise:  `phalanx run -n N`, rank 1 raises ValueError at step 5; seconds from the raise to the launcher's exit.
- kill:   `phalanx run -n 3`, rank 1 is killed with SIGKILL; seconds from the kill to the launcher's exit.
- ctrl-c: `phalanx run -n 3`, SIGINT to the whole process group (what Ctrl-C in a terminal does); seconds to exit.
- orphans: `phalanx run -n 2` (and `--elastic`) itself killed with SIGKILL while its workers train; seconds from the
          kill until every worker has exited (before, without --elastic, they trained on to the end).
- hung:   3 workers started directly, rank 1 frozen with SIGSTOP, PHALANX_TIMEOUT=10; seconds until the
          survivors raise WorkerLostError, and whether they name rank 1.
- blame:  3 and 4 workers started directly (no launcher, as torchrun or several hosts would), one rank killed with
          SIGKILL while another is busy elsewhere for 4 s; counts trials in which a survivor named a live rank.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
os.environ["PYTHONPATH"] = os.pathsep.join([os.path.join(ROOT, "tests"), os.path.join(ROOT, "src"),
                                            os.environ.get("PYTHONPATH", "")])
PHALANX = [sys.executable, "-c", "import sys; from phalanx.cli import main; sys.exit(main())"]

SCRIPT = """\
import json, os, sys, time
import torch, phalanx as px
px.init()
mode = sys.argv[1]
for step in range(100000):
    if step == 5 and (px.rank() == 1 or mode == "orphan"):
        print(json.dumps({"at": time.time(), "pid": os.getpid()}), flush=True)
        if mode == "raise":
            raise ValueError("boom")
        if mode == "wait":
            time.sleep(3600)
    t = torch.ones(4)
    px.Comm().all_reduce_([t])
    time.sleep(0.01)
"""


def _launch(workers: int, mode: str, path: str) -> subprocess.Popen:
    return subprocess.Popen([*PHALANX, "run", "-n", str(workers), path, mode], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)


def _marker(proc: subprocess.Popen) -> dict:
    for line in proc.stdout:
        if line.startswith("{"):
            return json.loads(line)
    raise RuntimeError(f"no marker; stderr: {proc.stderr.read()[-2000:]}")


def trial_launcher(mode: str, workers: int, path: str) -> tuple[float, str]:
    proc = _launch(workers, "raise" if mode == "raise" else "wait", path)
    mark = _marker(proc)
    if mode == "kill":
        os.kill(mark["pid"], signal.SIGKILL)
        start = time.time()
    elif mode == "ctrl-c":
        os.killpg(proc.pid, signal.SIGINT)
        start = time.time()
    else:
        start = mark["at"]
    _, err = proc.communicate(timeout=300)
    return time.time() - start, [line for line in err.splitlines() if line.startswith("phalanx:")][-1:]


def trial_orphans(workers: int, path: str, elastic: bool) -> tuple[float, list[str]]:
    """SIGKILL the launcher once every worker trains; seconds until they have all exited, and what they said."""
    import select
    proc = subprocess.Popen([*PHALANX, "run", "-n", str(workers), *(["--elastic"] if elastic else []), path,
                             "orphan"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    fds = [os.pidfd_open(_marker(proc)["pid"]) for _ in range(workers)]  # readable once that worker exited
    proc.kill()
    start = time.time()
    proc.wait()
    for fd in fds:
        select.select([fd], [], [], 300)
        os.close(fd)
    took = time.time() - start
    return took, [line for line in proc.stderr.read().splitlines() if line.startswith("phalanx: worker")][-1:]


def trial_direct(workers: int, victim: int, slow: int | None, how: str) -> tuple[float | None, list[str]]:
    from phalanx.bench.procs import run_workers
    if how == "kill":
        run = run_workers("workers.liveness:kill_one", world_size=workers, check=False, timeout=300,
                          env={"PHALANX_TIMEOUT": "20"}, victim=victim, slow=slow)
    else:
        run = run_workers("workers.liveness:freeze_one", world_size=workers, check=False, timeout=300,
                          env={"PHALANX_TIMEOUT": "10"}, victim=victim)
    survivors = [r for r in run.results if r and r.get("message")]
    after = max((r["after_s"] for r in survivors), default=None)
    return after, [r["message"] for r in survivors]


def blamed(message: str) -> set[int]:
    found = re.search(r"lost contact with rank\(s\) ([\d, ]+)", message)
    return {int(r) for r in found.group(1).split(",")} if found else set()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trials", type=int, default=10)
    p.add_argument("--only", default="raise,kill,ctrl-c,orphans,hung,blame")
    args = p.parse_args()
    parts = args.only.split(",")
    print(f"# failure detection, {args.trials} trial(s); load average {os.getloadavg()[0]:.1f} "
          f"on {os.cpu_count()} cores at the start")
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "train.py")
        with open(path, "w") as f:
            f.write(SCRIPT)
        for mode, workers in [("raise", 2), ("raise", 3), ("kill", 3), ("ctrl-c", 3)]:
            if mode not in parts:
                continue
            times, line = [], []
            for _ in range(args.trials):
                t, line = trial_launcher(mode, workers, path)
                times.append(t)
            print(f"{mode:7s} phalanx run -n {workers}: median {statistics.median(times):.2f} s, "
                  f"max {max(times):.2f} s over {len(times)}; last line: {line}", flush=True)
        for workers, elastic in [(2, False), (2, True)]:
            if "orphans" not in parts:
                continue
            times, line = [], []
            for _ in range(args.trials):
                t, line = trial_orphans(workers, path, elastic)
                times.append(t)
            how = f"phalanx run -n {workers}{' --elastic' if elastic else ''}"
            print(f"orphans {how} SIGKILLed: every worker gone after median {statistics.median(times):.2f} s, "
                  f"max {max(times):.2f} s over {len(times)}; last line: {line}", flush=True)
    if "hung" in parts:
        times, named = [], 0
        for _ in range(max(1, args.trials // 2)):
            t, messages = trial_direct(3, 1, None, "freeze")
            times.append(t)
            named += all(blamed(m) == {1} for m in messages) and len(messages) == 2
        print(f"hung    direct -n 3, PHALANX_TIMEOUT=10: survivors raise after median "
              f"{statistics.median(times):.1f} s; rank 1 named alone in {named}/{len(times)}", flush=True)
    if "blame" in parts:
        for workers, victim, slow in [(3, 1, 2), (4, 2, 0)]:
            wrong, times = 0, []
            for _ in range(args.trials):
                t, messages = trial_direct(workers, victim, slow, "kill")
                times.append(t)
                wrong += any(blamed(m) - {victim} for m in messages) or len(messages) != workers - 1
            print(f"blame   direct -n {workers}, kill rank {victim}, rank {slow} busy 4 s: a live rank named (or a "
                  f"survivor without a message) in {wrong}/{args.trials} trials; survivors raised after median "
                  f"{statistics.median(times):.1f} s", flush=True)


if __name__ == "__main__":
    main()
