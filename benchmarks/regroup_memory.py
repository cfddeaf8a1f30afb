"""A survivor's memory across many regroups: does each lost worker and each joiner leave memory behind?

Runs the chaos soak's job (``tests/workers/chaos_job.py``, small GPT, AdamW, float64) under
``phalanx run -n N --elastic --min-workers 1 --replace``, and kills the newest worker other
than worker ``0`` with SIGKILL, ``--kills`` times, each once the group has stepped again after
the previous replacement joined (so every kill makes one regroup and one grow). Worker ``0``
is never killed: its resident memory (``VmRSS``) is read after every grow, next to the count
of regroups it went through. A survivor that keeps state of each old generation grows by a
step per regroup; one that does not stays flat after its warm-up (first commit, first
checkpoint).

    python benchmarks/regroup_memory.py --out /tmp/rm --shard 2 --kills 12
    python benchmarks/regroup_memory.py --out /tmp/rm0 --kills 12          # unsharded, 3 workers

Prints one line per kill (RSS of worker 0 in MB) and the ratio of the last to the one after
the first grow; ``--json`` writes the series.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import signal
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
JOB = os.path.join(ROOT, "tests", "workers", "chaos_job.py")


def events(out: str) -> list[dict]:
    lines = []
    for path in glob.glob(os.path.join(out, "events", "*.jsonl")):
        with open(path) as f:
            for line in f.read().splitlines():
                try:
                    lines.append(json.loads(line))
                except ValueError:  # a line being written
                    pass
    return sorted(lines, key=lambda e: e["t"])


def rss_mb(pid: int) -> float | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def wait_for(what: str, cond, timeout_s: float, proc: subprocess.Popen):  # noqa: ANN001, ANN201
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = cond()
        if got:
            return got
        if proc.poll() is not None:
            raise SystemExit(f"the job ended (status {proc.returncode}) while waiting for {what}")
        time.sleep(0.05)  # a benchmark's poll of the job's files
    raise SystemExit(f"no {what} within {timeout_s:.0f}s")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--kills", type=int, default=12)
    p.add_argument("--shard", type=int, default=0, help="shard=px.FullyShard(group_size=S) on 4 workers")
    p.add_argument("--size", default="small", choices=("small", "tiny"))
    p.add_argument("--json", default=None, help="write the series here")
    p.add_argument("--src", default=os.path.join(ROOT, "src"), help="phalanx's source tree (an A/B against a copy)")
    a = p.parse_args(argv)
    out = os.path.abspath(a.out)
    os.makedirs(out, exist_ok=True)
    n = 4 if a.shard else 3
    job = ["--out", out, "--size", a.size, "--ckpt-every", "3"]
    job += ["--shard", str(a.shard), "--state-checkpoint"] if a.shard else []
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.join(ROOT, "tests"), a.src,
                                                       os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-c", "import sys; from phalanx.cli import main; sys.exit(main())", "run", "-n", str(n),
           "--elastic", "--min-workers", "1", "--replace", "--start-method", "forkserver", JOB, *job, "--census"]
    log = open(os.path.join(out, "launcher.log"), "w")  # noqa: SIM115 - lives as long as the job
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
    series = []
    try:
        first = wait_for("worker 0's first step", lambda: [e for e in events(out) if e["id"] == "0"
                                                          and e["ev"] == "step"], 300, proc)
        pid0 = first[0]["pid"]
        for k in range(a.kills):
            evs = events(out)
            live = {e["pid"]: e for e in evs if e["ev"] in ("init", "placed")}
            dead = {s["pid"] for s in series}
            victims = [e for pid, e in live.items() if e["id"] != "0" and pid not in dead and rss_mb(pid)]
            victim = max(victims, key=lambda e: e["t"])
            t = time.time()
            os.kill(victim["pid"], signal.SIGKILL)
            # the replacement joined (a grow ended on worker 0) and worker 0 stepped after it
            grown = wait_for("a grow after the kill", lambda t=t: [e for e in events(out) if e["pid"] == pid0
                                                                   and e["ev"] == "census" and e["where"] == "grow"
                                                                   and e["t"] > t], 300, proc)[-1]
            g = time.time()
            wait_for("a step after the grow", lambda g=g: [e for e in events(out) if e["pid"] == pid0
                                                           and e["ev"] == "step" and e["t"] > g], 300, proc)
            mb = rss_mb(pid0)
            held = {k: grown[k] for k in ("tensors", "tensor_mb", "objects", "threads")}
            series.append({"kill": k + 1, "pid": victim["pid"], "rss_mb": mb, "s": round(time.time() - t, 2), **held})
            print(f"kill {k + 1}: worker {victim['id']}; worker 0 RSS {mb:.1f} MB, after the grow {held} "
                  f"({time.time() - t:.1f}s to the step after the grow)", flush=True)
    finally:
        open(os.path.join(out, "stop"), "w").close()
        try:
            proc.wait(120)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    base = series[0]["rss_mb"]
    print(f"worker 0 RSS: {base:.1f} MB after the first grow, {series[-1]['rss_mb']:.1f} MB after the last "
          f"({series[-1]['rss_mb'] / base:.3f}x over {len(series) - 1} more regroups; "
          f"{(series[-1]['rss_mb'] - base) / max(1, len(series) - 1):.1f} MB each)")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"command": " ".join(sys.argv), "series": series}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
