"""torchft's DiLoCo on one of the quality tasks: ``diloco_peer.py TASK LR STEPS SYNC_EVERY OUT.json``.

Runs in torchft's own environment (benchmarks/torchft/setup.sh), never phalanx's: the parent
starts torchft's lighthouse, then two replica groups (one process each, gloo), each with
its own torchft Manager and ``torchft.local_sgd.DiLoCo`` (AdamW inner, Nesterov SGD outer
lr 0.7 momentum 0.9: the same settings as phalanx's DiLoCo in the benchmark). Every
replica draws its half of the same global batch as the other setups.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from datetime import timedelta


def replica(replica_id: int, lighthouse: str, task_name: str, lr: float, steps: int, every: int, out: str) -> None:
    import torch
    from torchft import Manager, ProcessGroupGloo
    from torchft.local_sgd import DiLoCo

    from phalanx.bench.quality.tasks import get

    torch.set_num_threads(1)
    # each replica group is one process: it hosts the store its Manager (rank 0) connects to
    store = torch.distributed.TCPStore("localhost", 0, is_master=True, wait_for_workers=False)
    task = get(task_name)
    torch.manual_seed(0)
    model = task.model()
    inner = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1)
    outer = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
    manager = Manager(pg=ProcessGroupGloo(), min_replica_size=2, use_async_quorum=False,
                      load_state_dict=model.load_state_dict, state_dict=model.state_dict,
                      replica_id=str(replica_id), store_addr="localhost", store_port=store.port, rank=0,
                      world_size=1, lighthouse_addr=lighthouse, port=19530 + replica_id,
                      timeout=timedelta(seconds=60), quorum_timeout=timedelta(seconds=60),
                      connect_timeout=timedelta(seconds=60))
    curve, clock = [], 0.0
    with DiLoCo(manager, [model], inner, outer, sync_every=every):
        for step in range(steps):
            x, y = task.batch(step, replica_id, 2, task.per_worker)
            start = time.perf_counter()
            inner.zero_grad(set_to_none=True)
            task.loss(model(x), y).backward()
            inner.step()
            clock += time.perf_counter() - start
            if (step + 1) % every == 0 and replica_id == 0:
                curve.append((clock, step + 1, task.evaluate(model)))
    manager.shutdown(wait=False)
    with open(out, "w") as f:
        json.dump({"replica": replica_id, "curve": curve, "train_seconds": clock}, f)


def main(argv: list[str]) -> int:
    if argv[0] == "--replica":
        replica(int(argv[1]), argv[2], argv[3], float(argv[4]), int(argv[5]), int(argv[6]), argv[7])
        return 0
    from torchft._torchft import LighthouseServer

    task, lr, steps, every, out = argv[0], argv[1], argv[2], argv[3], argv[4]
    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=2)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, __file__, "--replica", str(r), lighthouse.address(), task, lr, steps,
                               every, f"{out}.{r}"], env=env) for r in range(2)]
    codes = [p.wait(timeout=900) for p in procs]
    lighthouse.shutdown()
    if any(codes):
        print(f"torchft DiLoCo failed: exit codes {codes}", file=sys.stderr)
        return 1
    with open(f"{out}.0") as f:
        result = json.load(f)
    with open(out, "w") as f:
        json.dump(result, f)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
