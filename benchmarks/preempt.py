"""Time from SIGTERM to the end of a `phalanx run -n 2` job that saves a checkpoint on preemption.

    python benchmarks/preempt.py                      # digits CNN and a ~100M-parameter GPT
    python benchmarks/preempt.py --models digits_cnn  # just one
    python benchmarks/preempt.py --models gpt100m --grace 120   # a longer window before SIGKILL

For each model: start the job (Trainer-free user loop, AllReduce, SGD), wait until rank 0
has taken a few steps (a file it writes), send SIGTERM to the launcher, and time until the
launcher exits. Prints the seconds, the exit status (75: preempted), the step it stopped
after and the checkpoint's size. Also prints what the step boundary costs when no signal
came (the check every optimizer step runs). Run on a shared machine the figures are
"under load"; the target is the common 30 s grace window.
"""
from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
import timeit

WORKER = r'''
import os, sys, torch, torch.nn.functional as F
import phalanx as px
from phalanx.bench import models

name, ready = sys.argv[1], sys.argv[2]
px.init()
torch.manual_seed(0)
if name == "digits_cnn":
    net, x, y = models.digits_cnn(), torch.randn(64, 1, 8, 8), torch.randint(0, 10, (64,))
    loss_of = lambda out: F.cross_entropy(out, y)
else:  # a GPT of about 100M parameters (8 layers of width 1024, vocabulary 8192)
    net = models.gpt(vocab=8192, context=64, dim=1024, layers=8, heads=16)
    x = torch.randint(0, 8192, (2, 64)); y = torch.randint(0, 8192, (2, 64))
    loss_of = lambda out: F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))
model, opt = px.wrap(net, torch.optim.SGD(net.parameters(), lr=0.01))
if px.is_main():
    print(f"{name}: {sum(p.numel() for p in net.parameters()) / 1e6:.1f}M parameters", flush=True)
step = 0
while True:
    opt.zero_grad()
    loss_of(model(x)).backward()
    opt.step()
    step += 1
    if step == 3 and px.is_main():
        open(ready, "w").close()
    if px.preempted():
        px.save_checkpoint(os.path.join(px.step.preempt.checkpoint_dir(), f"step-{step}.pt"), model, opt, step=step)
        raise SystemExit(px.PREEMPTED_EXIT)
'''


def one(model: str, workdir: str, grace: str) -> None:
    script, ready, ckpt = (os.path.join(workdir, n) for n in (f"{model}.py", f"{model}.ready", f"ckpt-{model}"))
    with open(script, "w") as f:
        f.write(WORKER)
    cmd = [sys.executable, "-m", "phalanx.cli", "run", "-n", "2", "--grace", grace, "--checkpoint-dir", ckpt,
           script, model, ready]
    job = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 600
    while not os.path.exists(ready):
        if job.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"{model}: the job ended or never reached step 3: {job.stderr.read()[-2000:]}")
        time.sleep(0.05)
    sent = time.monotonic()
    job.send_signal(signal.SIGTERM)
    _, err = job.communicate(timeout=600)
    seconds = time.monotonic() - sent
    saved = [os.path.join(ckpt, n) for n in os.listdir(ckpt)] if os.path.isdir(ckpt) else []
    # a checkpoint is a DCP directory (or a one-file checkpoint of earlier versions): count every file in it
    size = sum(os.path.getsize(os.path.join(d, f)) for p in saved
               for d, _, fs in (os.walk(p) if os.path.isdir(p) else [(os.path.dirname(p), [], [os.path.basename(p)])])
               for f in fs) / 2**20
    line = next((ln for ln in err.splitlines() if "received SIGTERM" in ln), err.strip()[-300:])
    print(f"{model}: SIGTERM -> exit {seconds:.2f} s, status {job.returncode}, checkpoint "
          f"{[os.path.basename(p) for p in saved]} {size:.0f} MiB\n  launcher: {line}", flush=True)


def boundary_cost() -> None:
    import phalanx as px
    from phalanx.step import preempt

    p = preempt.of(px.init())
    n = 200_000
    s = timeit.timeit(lambda: p.at_boundary(1), number=n) - timeit.timeit(lambda: None, number=n)
    print(f"step boundary with no signal: {s / n * 1e9:.0f} ns per optimizer step", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="digits_cnn,gpt100m")
    ap.add_argument("--grace", default="30", help="phalanx run --grace: seconds before SIGKILL (default 30)")
    a = ap.parse_args()
    boundary_cost()
    with tempfile.TemporaryDirectory(prefix="phalanx-preempt-bench-") as d:
        for m in a.models.split(","):
            one(m, d, a.grace)


if __name__ == "__main__":
    main()
