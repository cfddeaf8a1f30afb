"""A preempted job under a periodic strategy, whose workers drift apart between syncs (tests/step/test_preempt.py).

    phalanx run -n 2 --checkpoint-dir CKPT [--resume-from auto] preempt_periodic.py OUT STRATEGY [--drift]

STRATEGY is ``local-sgd`` or ``diloco``, both syncing every 8 steps. ``--drift`` arranges the
signal so that the workers hear it far apart: rank 0 waits for it after step 1, rank 1 after
step 2; once heard, rank 1 runs ahead on its local steps and rank 0 waits until rank 1 has
finished step 7 (it then waits for rank 0 in step 8's sync). Rank 1 has told the others at
step 3, rank 0 tells them last at step 2: a stop "the step after the last one heard" (3) is one
rank 1 has passed already. Without ``--drift`` the run is uninterrupted (the reference).
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import phalanx as px  # noqa: E402
from phalanx.step import preempt  # noqa: E402
from workers.preempt import BATCH, EPOCHS, data, make_model  # noqa: E402
from support.preempt_job import train_preemptible  # noqa: E402
from support.wait import until  # noqa: E402

STRATEGIES = {"local-sgd": lambda: px.LocalSGD(every=8), "diloco": lambda: px.DiLoCo(every=8)}


def wait_for(path: str) -> None:
    until(lambda: os.path.exists(path), timeout=120, what=f"the other worker's {path}")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("strategy", choices=sorted(STRATEGIES))
    p.add_argument("--drift", action="store_true")
    a = p.parse_args()
    px.init()
    torch.manual_seed(1)
    net = make_model()
    model, opt = px.wrap(net, torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9),
                         strategy=STRATEGIES[a.strategy]())
    loader = px.shard(data(), batch_size=BATCH, shuffle=True, seed=0)
    heard = preempt.of().heard

    def on_step(step: int) -> None:
        if a.drift and px.resume_from() is None:
            if px.rank() == 1:
                open(f"{a.out}.rank1-{step}", "w").close()
            if step == 1 + px.rank():  # rank 0 after step 1, rank 1 after step 2: wait for the signal there
                open(f"{a.out}.reached{px.rank()}", "w").close()
                assert heard.wait(120), "no signal came"
                if px.rank() == 0:
                    wait_for(f"{a.out}.rank1-7")

    train_preemptible(model, opt, loader, EPOCHS, on_step)
    px.save(model, a.out)
    px.shutdown()


def reference(out: str, strategy: str) -> None:
    """The uninterrupted run (no ``--drift``) as a ``run_workers`` target: the ranks forked from the tests' preloaded
    server, with the variables ``phalanx run`` gives them, rather than a launcher and two fresh interpreters."""
    sys.argv = [__file__, out, strategy]
    main()


if __name__ == "__main__":
    main()
