"""A user's own loop that a preemption stops and ``--resume-from auto`` continues (run by tests/step/test_preempt.py).

    phalanx run -n 2 --checkpoint-dir CKPT [--resume-from auto] preempt.py OUT [WAIT_AT] [--hang-before-save]
                                                                     [--hold-before-save] [--wait-at-end]

Rank 0 writes ``OUT.reached`` after step WAIT_AT, and every worker waits there until it heard the signal itself
(the test sends it when it sees the file), so the stop step is deterministic without sleeps: every worker tells
the others at boundary WAIT_AT+1 and stops after WAIT_AT+2. Waiting on rank 0 alone was not enough: under SLURM
each node's daemon signals its own processes, and a worker that heard it a second later (a loaded machine) let
the others train to the end of the script first.
With --wait-at-end every worker writes ``OUT.end-RANK`` once its training and its save are done and waits for
the signal there, then ends normally (exit 0): the signal came too late to stop anything.
With --hold-before-save, rank 0 writes ``OUT.saving`` once stopped and waits for ``OUT.go`` before it saves: the
test sends its repeated signals there, inside the launcher's grace.
"""
from __future__ import annotations

import argparse
import os
import signal
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import phalanx as px  # noqa: E402
from phalanx.step import preempt  # noqa: E402
from support.preempt_job import train_preemptible  # noqa: E402
from support.wait import until  # noqa: E402

EPOCHS, N, BATCH = 2, 64, 4


def data() -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(0)
    return torch.utils.data.TensorDataset(torch.randn(N, 8, generator=g), torch.randint(0, 3, (N,), generator=g))


def make_model() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("wait_at", nargs="?", type=int, default=-1)
    p.add_argument("--hang-before-save", action="store_true", help="rank 1 never saves (it hangs once stopped)")
    p.add_argument("--hold-before-save", action="store_true", help="rank 0 saves once OUT.go exists")
    p.add_argument("--wait-at-end", action="store_true", help="every rank waits for the signal after its save")
    a = p.parse_args()
    px.init()
    torch.manual_seed(1)
    net = make_model()
    model, opt = px.wrap(net, torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9))
    loader = px.shard(data(), batch_size=BATCH, shuffle=True, seed=0)

    def on_step(step: int) -> None:
        if step == a.wait_at:
            if px.rank() == 0:
                with open(a.out + ".reached", "w") as f:
                    f.write(str(step))
            assert preempt.of().heard.wait(120), "no signal came"

    def before_save() -> None:
        if a.hold_before_save and px.rank() == 0:
            with open(a.out + ".saving", "w") as f:
                f.write(str(os.getpid()))
            until(lambda: os.path.exists(a.out + ".go"), timeout=600, what="the test's OUT.go")
        if a.hang_before_save and px.rank() == 1:
            while True:  # until the launcher's grace runs out and it kills this worker
                signal.pause()

    train_preemptible(model, opt, loader, EPOCHS, on_step, before_save)
    px.save(model, a.out)
    if a.wait_at_end:
        with open(f"{a.out}.end-{px.rank()}", "w"):
            pass
        assert preempt.of().heard.wait(120), "no signal came"
    px.shutdown()


if __name__ == "__main__":
    main()
