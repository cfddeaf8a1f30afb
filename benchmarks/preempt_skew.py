"""A preemption signal that reaches the processes of a two-host job at different moments, many times: count outcomes.

    python benchmarks/preempt_skew.py                    # 24 trials, up to 30 ms between two processes' signals
    python benchmarks/preempt_skew.py --trials 40 --skew-ms 50

Each trial starts a job as SLURM runs one on two nodes: two `phalanx run -n 1 --nnodes 2 --node-rank R` launchers
on this machine, one worker each, a user's loop that saves a checkpoint and exits 75 once `px.preempted()`. Rank 0
waits after step 5 for the signal; the other rank runs on. Then every process of both launchers' trees (the
launchers and their workers) gets SIGUSR1 in a random order, up to ``--skew-ms`` apart, as each node's daemon
signals its own processes. Each trial ends one of three ways:

* preempted: both launchers exit 75 and name the step; a checkpoint is there;
* complete: a worker heard the signal after the training had ended; both launchers exit 0 and say so;
* wrong: anything else (before `phalanx.launch.stopping`: the workers finished, the launchers said "stopped all
  workers" and exited 138, 3 trials of 41 here).

Prints one line per trial and the counts; exits 1 on any wrong outcome.
"""
from __future__ import annotations

import argparse
import os
import random
import signal
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "src"))

from phalanx.launch.ports import free_port  # noqa: E402

WORKER = r'''
import os, sys, torch
import phalanx as px
from phalanx.step import preempt

out, ckpt = sys.argv[1], sys.argv[2]
px.init()
torch.manual_seed(1)
net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
model, opt = px.wrap(net, torch.optim.SGD(net.parameters(), lr=0.1))
g = torch.Generator().manual_seed(0)
x, y = torch.randn(128, 8, generator=g), torch.randint(0, 3, (128,), generator=g)
for step in range(1, 17):
    i = torch.arange(4) + 4 * (2 * step + px.rank()) % 124
    opt.zero_grad(); torch.nn.functional.cross_entropy(model(x[i]), y[i]).backward(); opt.step()
    if step == 5 and px.rank() == 0:
        open(out + ".reached", "w").close()
        assert preempt.of().heard.wait(120), "no signal came"
    if px.preempted():
        px.save_checkpoint(os.path.join(ckpt, f"step-{step}.pt"), model, opt, step=step)
        raise SystemExit(px.PREEMPTED_EXIT)
px.save(model, out)
px.shutdown()
'''


def _tree(root: int) -> list[int]:
    """``root`` and every process below it (from /proc)."""
    below: dict[int, list[int]] = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                parent = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError):
            continue
        below.setdefault(parent, []).append(int(pid))
    found, todo = [], [root]
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo += below.get(pid, [])
    return found


def trial(index: int, skew_s: float, folder: str) -> str:
    d = tempfile.mkdtemp(prefix=f"trial{index}-", dir=folder)
    script, out, ckpt = os.path.join(d, "worker.py"), os.path.join(d, "model.pt"), os.path.join(d, "ckpt")
    with open(script, "w") as f:
        f.write(WORKER)
    port = free_port()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.join(REPO, "src"), os.environ.get("PYTHONPATH", "")])}
    launchers = [subprocess.Popen([sys.executable, "-m", "phalanx.cli", "run", "-n", "1", "--nnodes", "2",
                                   "--node-rank", str(r), "--master-addr", "127.0.0.1", "--master-port", str(port),
                                   "--checkpoint-dir", ckpt, script, out, ckpt],
                                  env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
                 for r in (0, 1)]
    deadline = time.monotonic() + 300
    while not os.path.exists(out + ".reached"):  # polling a file another process writes; no event to wait on
        if time.monotonic() > deadline or any(p.poll() is not None for p in launchers):
            for p in launchers:
                p.kill()
            return "wrong (the job did not reach step 5)"
        time.sleep(0.02)
    processes = _tree(launchers[0].pid) + _tree(launchers[1].pid)
    random.shuffle(processes)
    for pid in processes:
        try:
            os.kill(pid, signal.SIGUSR1)
        except ProcessLookupError:
            pass
        time.sleep(random.random() * skew_s)  # the skew between two processes' signals
    ended = [(p.wait(timeout=300), p.stderr.read()) for p in launchers]
    codes = [c for c, _ in ended]
    if codes == [75, 75] and all("the workers stopped after step" in e for _, e in ended) and os.listdir(ckpt):
        return "preempted"
    if codes == [0, 0] and all("the job is complete" in e for _, e in ended) and os.path.exists(out):
        return "complete"
    return f"wrong: exit {codes}: " + " | ".join(e.strip().replace("\n", " / ")[-300:] for _, e in ended)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trials", type=int, default=24)
    p.add_argument("--skew-ms", type=float, default=30.0, help="the most between two processes' signals")
    a = p.parse_args()
    counts: dict[str, int] = {}
    with tempfile.TemporaryDirectory(prefix="preempt-skew-") as folder:
        for i in range(a.trials):
            outcome = trial(i, a.skew_ms / 1000, folder)
            print(f"trial {i}: {outcome}", flush=True)
            key = outcome.split(":")[0]
            counts[key] = counts.get(key, 0) + 1
    tally = ", ".join(f"{k} {v}" for k, v in sorted(counts.items()))
    print(f"{a.trials} trials, skew up to {a.skew_ms:g} ms: {tally}")
    return 1 if any(k.startswith("wrong") for k in counts) else 0


if __name__ == "__main__":
    sys.exit(main())
