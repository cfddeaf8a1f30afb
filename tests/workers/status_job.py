"""A job for the status page tests: trains until the test says stop; one worker can be made slow.

``phalanx run [--elastic] -n N --status PORT tests/workers/status_job.py --out DIR [--slow ID:CAUSE [--then ID:CAUSE]]``

Every worker trains a small model on ``px.shard`` batches, in the user's own loop (under
``--elastic`` inside ``px.elastic.State``). ``--slow 1:compute`` makes worker 1 spin
``--spin-ms`` in each step between forward and backward; ``1:input`` makes its dataset spin as
long for each batch, so its loader is the slow part. Once ``DIR/next`` exists, ``--then`` says
who is slow instead. A worker writes ``DIR/training<ID>`` at
its first step; every 10 steps the group agrees (one all-reduce) whether ``DIR/stop`` exists,
and stops together when it does, each worker then writing ``DIR/worker<ID>.json``: its own
record of the job (generation, world size, step, bytes per step).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import phalanx as px  # noqa: E402
from support.loop import elastic_id  # noqa: E402

p = argparse.ArgumentParser()
p.add_argument("--out", required=True)
p.add_argument("--slow", default=":")
p.add_argument("--then", default=None)
p.add_argument("--spin-ms", type=float, default=15.0)
args = p.parse_args()
me = elastic_id()
SPIN_S = args.spin_ms / 1e3
BATCH = 8


def spin(seconds: float) -> None:
    """Extra work in this worker's loop (busy, like real compute or decoding: it holds a core)."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


class Data(torch.utils.data.Dataset):
    def __init__(self) -> None:
        g = torch.Generator().manual_seed(0)
        self.x, self.y = torch.randn(4096, 16, generator=g), torch.randn(4096, 1, generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        if slow == "input":
            spin(SPIN_S / BATCH)  # the whole batch takes SPIN_S longer to make
        return self.x[i], self.y[i]


px.init()
torch.manual_seed(0)
net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
model, opt = px.wrap(net, torch.optim.SGD(net.parameters(), lr=0.01))


def slowness(spec: str) -> str:
    """What is slow on this worker under ``ID:CAUSE``: "compute", "input" or ""."""
    who, _, cause = spec.partition(":")
    return cause if who == me else ""


slow = slowness(args.slow)
loader = px.shard(Data(), batch_size=BATCH, seed=0)
comm = px.Comm()
stop_file, started = os.path.join(args.out, "stop"), False
sent: list[int] = []  # the rule's bytes sent so far, at each 10th step: what this worker itself says it sends


def step(x: torch.Tensor, y: torch.Tensor) -> bool:
    """One step; True when the group agreed to stop."""
    global started, slow
    opt.zero_grad()
    loss = F.mse_loss(model(x), y)
    if slow == "compute":
        spin(SPIN_S)
    loss.backward()
    opt.step()
    if not started:
        started = True
        open(os.path.join(args.out, f"training{me}"), "w").close()
    if px.strategy_of(opt).clock.step % 10:  # the step count every worker agrees on (rolled back with a commit)
        return False
    sent.append(px.strategy_of(opt).bytes_sent)
    if args.then is not None and os.path.exists(os.path.join(args.out, "next")):
        slow = slowness(args.then)
    flag = torch.tensor([1.0 if os.path.exists(stop_file) else 0.0])
    comm.all_reduce_([flag], op="sum")  # every worker stops at the same step, or one would wait for the others
    return flag.item() > 0


def epoch_until_stopped(epoch: int) -> bool:
    """One epoch of steps; True once the group agreed to stop."""
    loader.set_epoch(epoch)
    return any(step(x, y) for x, y in loader)  # any() stops at the first True: the agreed step


if os.environ.get("PHALANX_ELASTIC_ID"):
    state = px.elastic.State(model, opt, loader, commit_every=5)
    stopping = False  # a change inside `with state:` ends the epoch without an answer: it is redone
    for epoch in state.epochs(10_000):
        with state:
            stopping = epoch_until_stopped(epoch)
        if stopping:
            break
else:
    for epoch in range(10_000):
        if epoch_until_stopped(epoch):
            break

rule = px.strategy_of(opt)
with open(os.path.join(args.out, f"worker{me}.json"), "w") as f:
    json.dump({"id": me, "rank": px.rank(), "world_size": px.world_size(),
               "generation": px.current_group().generation, "step": rule.clock.step, "strategy": type(rule).__name__,
               "bytes_per_step": (sent[-1] - sent[-2]) / 10 if len(sent) > 1 else None, "pid": os.getpid()}, f)
px.shutdown()
