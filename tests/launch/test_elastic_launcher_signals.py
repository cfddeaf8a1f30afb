"""The elastic launcher and a scheduler's signals: SIGTERM or SIGUSR1 to ``phalanx run --elastic`` stops the whole
job with one line, the workers with it.

SLURM's ``--signal=USR1@N`` (without ``B:``) sends SIGUSR1 to the job step's processes, the launcher included; by
SIGUSR1's default action it died then, its workers left to end as orphans within the heartbeat timeout, and no line
said why. Real processes: a launcher forked from the test's server, two workers that say they stepped, a real signal.
"""
from __future__ import annotations

import os
import signal

import pytest

from phalanx.elastic.options import DEFAULT_HEARTBEAT_S
from support.forked_launch import start_cli
from support.wait import exited, until

SCRIPT = """\
import os, sys
import torch, phalanx as px

px.init()
model = torch.nn.Linear(2, 1)
model, opt = px.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1))
ready = os.path.join(sys.argv[1], f"ready-{os.getpid()}")
while True:  # "training" until the launcher stops it
    opt.zero_grad()
    model(torch.ones(4, 2)).sum().backward()
    opt.step()
    if not os.path.exists(ready):
        open(ready, "w").close()
"""


def _ready(out) -> list[int]:
    return [int(n.split("-")[1]) for n in os.listdir(out) if n.startswith("ready-")]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.multiproc
def test_sigusr1_to_the_elastic_launcher_stops_the_job_with_one_line(tmp_path):
    sig = signal.SIGUSR1
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    launcher = start_cli(["run", "-n", "2", "--elastic", str(script), str(tmp_path)], str(tmp_path))
    try:
        until(lambda: len(_ready(tmp_path)) == 2, timeout=4 * DEFAULT_HEARTBEAT_S, what="the workers' first steps",
              procs=[launcher])
        os.kill(launcher.pid, sig)
        code = exited(launcher, timeout=4 * DEFAULT_HEARTBEAT_S, what="the launcher")
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
    stderr = (tmp_path / "launcher.err").read_text()
    assert code == 128 + sig, stderr[-3000:]
    assert f"received {signal.Signals(sig).name}; stopped all workers" in stderr
    # stopped by the launcher (its forked parent reaps it within moments), not left to the heartbeat timeout
    until(lambda: not any(map(_alive, _ready(tmp_path))), timeout=DEFAULT_HEARTBEAT_S / 2, what="the workers' end")
