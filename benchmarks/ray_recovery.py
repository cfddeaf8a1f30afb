"""Kill -> first step of the recovered job under Ray: phalanx on Ray beside Ray Train's restart from a checkpoint.

    PYTHONPATH=src python benchmarks/ray_recovery.py [--steps 200 --kill-at 15 --every 10 --step-ms 50]

Both runs train the same MLP on 3 Ray Train workers (one local Ray node, 3 CPUs),
save state every ``--every`` steps, and lose the worker of rank 1 at step ``--kill-at``:
it writes its pid and parks, and this script kills its actor's process with SIGKILL
``--settle`` seconds later.

- ``phalanx``: ``phalanx.launch.raytrain.train`` (a replica group per worker; survivors regroup in
  process and roll back to their newest in-memory commit; Ray starts one replacement, which
  joins at a later commit).
- ``ray``: ``ray.train.torch.TorchTrainer`` with ``FailureConfig(max_failures=1)``: Ray Train
  restarts every worker, which loads the newest checkpoint reported with ``ray.train.report``.

Printed per run: kill -> first training step after it, kill -> 3 workers training again
(for ``phalanx``: Ray's own replacement time, the kill to the replacement's first step, which
sets how often a chaos soak may kill under Ray), and the steps redone. Take the figures as
what they are on the machine that ran them.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import tempfile
import threading
import time

import torch
import torch.nn.functional as F

WORKERS = 3


def _net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))


def _batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step * 100 + rank)
    return torch.randn(64, 32, generator=g), torch.randint(0, 10, (64,), generator=g)


def _note(out: str, name: str, data: dict) -> None:
    with open(os.path.join(out, name), "w") as f:
        json.dump(data, f)


def _park_if_victim(out: str, rank: int, step: int, kill_at: int) -> None:
    """The worker of rank 1 writes its pid before step ``kill_at`` (first time only) and waits to be killed."""
    if rank == 1 and step + 1 == kill_at and not os.path.exists(os.path.join(out, "victim.json")):
        _note(out, "victim.tmp", {"pid": os.getpid()})
        os.replace(os.path.join(out, "victim.tmp"), os.path.join(out, "victim.json"))  # the killer reads it whole
        time.sleep(3600)


def phalanx_worker(out: str, steps: int, kill_at: int, every: int, step_ms: float) -> None:
    """The phalanx loop: px.elastic.State commits in memory every ``every`` steps."""
    import phalanx as px

    px.init()
    me = os.environ.get("PHALANX_ELASTIC_ID", "?")
    net = _net()
    model, opt = px.wrap(net, torch.optim.SGD(net.parameters(), lr=0.01), strategy=px.AllReduce())
    state = px.elastic.State(model, opt, commit_every=every)
    seen = {"changes": 0}

    @px.elastic.run
    def train(state: px.elastic.State) -> None:
        while state.step < steps:
            if len(state.history) > seen["changes"]:
                seen["changes"] = len(state.history)
                _note(out, f"phalanx-change{seen['changes']}-{me}.json",
                      {"time": time.time(), "world": px.world_size(), "step": state.step,
                       "redone": state.history[-1]["redone_steps"]})
            _park_if_victim(out, px.rank() if not state.history else -1, state.step, kill_at)
            x, y = _batch(state.step, px.rank())
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
            time.sleep(step_ms / 1000)

    train(state)


def ray_worker(config: dict) -> None:
    """The Ray Train loop: DDP, a checkpoint reported every ``every`` steps, resumed from after a restart."""
    import ray.train
    import ray.train.torch

    out, steps, kill_at, every, step_ms = (config[k] for k in ("out", "steps", "kill_at", "every", "step_ms"))
    rank = ray.train.get_context().get_world_rank()
    model = ray.train.torch.prepare_model(_net())
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    start, restarted = 0, ray.train.get_checkpoint() is not None
    if restarted:
        with ray.train.get_checkpoint().as_directory() as d:
            saved = torch.load(os.path.join(d, "state.pt"), weights_only=True)
        model.module.load_state_dict(saved["model"])
        opt.load_state_dict(saved["opt"])
        start = saved["step"]
    for step in range(start, steps):
        if step == start:  # every attempt's first step; those after the kill are the restart's
            _note(out, f"ray-start-{rank}-{os.getpid()}.json", {"time": time.time(), "step": step})
        _park_if_victim(out, rank, step, kill_at)
        x, y = _batch(step, rank)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
        time.sleep(step_ms / 1000)
        if (step + 1) % every == 0:
            with tempfile.TemporaryDirectory() as d:
                if rank == 0:
                    torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(), "step": step + 1},
                               os.path.join(d, "state.pt"))
                ray.train.report({"step": step + 1},
                                 checkpoint=ray.train.Checkpoint.from_directory(d) if rank == 0 else None)


def killer(out: str, done: threading.Event, settle_s: float) -> dict:
    """Wait for the victim's pid, then ``settle_s`` more, and kill -9 it; the dict it returns gets the time.

    Ray Train's controller learns of a reported checkpoint when it next polls the workers
    (every 2 s): a worker lost before that poll sends the restart back to the checkpoint
    before. The pause lets both runs lose only the steps since their last save.
    """
    path, killed = os.path.join(out, "victim.json"), {}

    def run() -> None:
        while not os.path.exists(path) and not done.is_set():
            time.sleep(0.02)
        if done.is_set():
            return
        time.sleep(settle_s)  # after the file appeared: the victim is parked
        os.kill(json.load(open(path))["pid"], signal.SIGKILL)
        killed["time"] = time.time()

    threading.Thread(target=run, daemon=True).start()
    return killed


def run_phalanx(args: argparse.Namespace, out: str) -> dict:
    from phalanx.launch.raytrain import train

    done = threading.Event()
    killed = killer(out, done, args.settle)
    train(phalanx_worker, out, args.steps, args.kill_at, args.every, args.step_ms, num_workers=WORKERS,
          min_workers=2, max_failures=1)
    done.set()
    changes = [json.load(open(os.path.join(out, f))) for f in sorted(os.listdir(out)) if f.startswith("phalanx-change")]
    shrink = [c for c in changes if c["world"] < WORKERS]
    regrown = [c for c in changes if c["world"] == WORKERS]
    return {"kill_to_first_step_s": min(c["time"] for c in shrink) - killed["time"],
            "kill_to_3_workers_s": (min(c["time"] for c in regrown) - killed["time"]) if regrown else None,
            "steps_redone": shrink[0]["redone"], "processes_started": 1}


def run_ray(args: argparse.Namespace, out: str) -> dict:
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    done = threading.Event()
    killed = killer(out, done, args.settle)
    config = {"out": out, "steps": args.steps, "kill_at": args.kill_at, "every": args.every, "step_ms": args.step_ms}
    TorchTrainer(ray_worker, train_loop_config=config, scaling_config=ScalingConfig(num_workers=WORKERS),
                 run_config=RunConfig(storage_path=os.path.join(out, "storage"),
                                      failure_config=FailureConfig(max_failures=1))).fit()
    done.set()
    starts = [json.load(open(os.path.join(out, f))) for f in os.listdir(out) if f.startswith("ray-start")]
    restarts = [s for s in starts if s["time"] > killed["time"]]
    first = min(r["time"] for r in restarts) - killed["time"]
    return {"kill_to_first_step_s": first, "kill_to_3_workers_s": first,
            "steps_redone": args.kill_at - 1 - restarts[0]["step"], "processes_started": WORKERS}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--kill-at", type=int, default=15)
    p.add_argument("--every", type=int, default=10, help="steps between commits / checkpoints")
    p.add_argument("--step-ms", type=float, default=50.0, help="extra time per step (a stand-in for compute)")
    p.add_argument("--settle", type=float, default=5.0, help="seconds the victim stays parked before the kill")
    p.add_argument("--modes", default="phalanx,ray")
    p.add_argument("--verbose", action="store_true", help="show the workers' and Ray's output")
    args = p.parse_args()
    import ray

    ray.init(num_cpus=WORKERS, include_dashboard=False, object_store_memory=80 * 1024 ** 2,
             log_to_driver=args.verbose)
    rows = {}
    for mode in args.modes.split(","):
        with tempfile.TemporaryDirectory(prefix=f"ray-recovery-{mode}-") as out:
            began = time.time()
            rows[mode] = (run_phalanx if mode == "phalanx" else run_ray)(args, out)
            rows[mode]["wall_s"] = time.time() - began
        print(mode, json.dumps({k: round(v, 2) if isinstance(v, float) else v for k, v in rows[mode].items()}),
              flush=True)
    ray.shutdown()


if __name__ == "__main__":
    main()
