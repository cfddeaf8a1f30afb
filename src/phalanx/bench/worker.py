"""One benchmark worker process: ``python -m phalanx.bench.worker CONFIG.json OUT.json``.

The runner starts one of these per rank with the standard variables (``RANK``,
``WORLD_SIZE``, ``MASTER_ADDR``...). It builds the model from :data:`phalanx.bench.models.ZOO`,
trains it on synthetic data with the configured setup (plain loop, raw DDP, or a
phalanx strategy), times every step, warm-up included, and writes the raw numbers.

The loop is the same for every setup, the probe's hooks included, so ratios
between setups compare like with like.
"""
from __future__ import annotations

import json
import os
import sys
import time
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ..ps.report import load_report
from ..strategies.accounting import bytes_sent
from . import models
from .breakdown import StepProbe
from .spec import Setup, build_strategy

POOL = 4  # distinct synthetic batches, cycled: data wait stays near zero, as with a fast loader


def setup_training(setup: Setup, model: nn.Module, opt: torch.optim.Optimizer) -> tuple[nn.Module, Any]:
    """Make ``model``/``opt`` train under ``setup``; returns (module to call, accountant).

    The accountant answers ``bytes_sent()`` and ``calls()`` so far (payload bytes this
    worker put into collectives, and how many), and ``extra()``, strategy-specific figures.
    """
    if setup.kind == "plain":
        return model, Accountant()
    if setup.kind == "phalanx":
        import phalanx as px
        px.init()
        strategy = build_strategy(setup)
        size = int(setup.kwargs.get("shard", 1))  # allreduce[shard=2]: FSDP over groups of 2 (phalanx.sharding)
        grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
        module, _ = px.wrap(model, opt, strategy=strategy, shard=px.FullyShard(group_size=size) if size > 1 else None)
        acc = StrategyAccountant(strategy)
        if size > 1:
            acc.fsdp_bytes = fsdp_payload(grad_bytes, size, px.world_size(), hsdp=setup.name == "allreduce")
            opt.register_step_post_hook(acc.count_step)
        return module, acc
    return _ddp(setup, model, opt)


def _ddp(setup: Setup, model: nn.Module, opt: torch.optim.Optimizer) -> tuple[nn.Module, Any]:
    """The peer: torch DDP with its defaults unless the setup's arguments say otherwise."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    if not dist.is_initialized():
        dist.init_process_group("gloo")
    kw = setup.kwargs
    options: dict[str, Any] = {"bucket_cap_mb": kw.get("bucket_mb")}
    if setup.name == "ddp-powersgd" and options["bucket_cap_mb"] is None:
        # torch's PowerSGD hook on gloo with two or more buckets can issue its collectives in a different order
        # on different ranks (gloo: "Received data size doesn't match expected size"); DDP's default makes a
        # 1 MB first bucket, an explicit 25 MB cap makes one bucket for models up to 25 MB.
        options["bucket_cap_mb"] = 25
    for name in ("static_graph", "broadcast_buffers", "gradient_as_bucket_view"):
        if name in kw:
            options[name] = bool(kw[name])
    ddp = DDP(model, **options)
    grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    acc = PeerAccountant(grad_bytes)
    opt.register_step_post_hook(acc.count_step)
    if setup.name == "ddp-fp16":
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
        acc.factor = 0.5
    elif setup.name == "ddp-powersgd":
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as P
        # start_powerSGD_iter defaults to 1000 (plain all-reduce until then); 2 is the smallest it takes.
        state = P.PowerSGDState(None, matrix_approximation_rank=int(kw.get("rank", 4)),
                                start_powerSGD_iter=int(kw.get("start_iter", 2)), warm_start=True,
                                use_error_feedback=True)
        ddp.register_comm_hook(state, P.powerSGD_hook)
        acc.powersgd = state
    return ddp, acc


class Accountant:
    def bytes_sent(self) -> float:
        return 0.0

    def calls(self) -> int:
        return 0

    def period(self) -> int:
        return 1

    def extra(self) -> dict[str, Any]:
        return {}

    def finish(self) -> None:
        pass


def fsdp_payload(grad_bytes: int, shard: int, world: int, *, hsdp: bool) -> float:
    """Payload bytes one worker puts into FSDP's collectives per step, counted from the layout (FSDP's own
    collectives are not intercepted): its shard into the all-gathers of forward and backward, the whole
    gradient into the reduce-scatter and, under HSDP with several replica groups, its gradient shard into the
    all-reduce across them.

    Example:
        >>> fsdp_payload(400, 2, 4, hsdp=True)
        1000.0
    """
    replicas = world // shard
    return grad_bytes * (2 / shard + 1 + (1 / shard if hsdp and replicas > 1 else 0))


class StrategyAccountant(Accountant):
    def __init__(self, strategy: Any) -> None:
        self.strategy = strategy
        self.fsdp_bytes, self.steps = 0.0, 0  # a sharded setup: FSDP's payload per step, and steps so far

    def count_step(self, *_: Any) -> None:
        self.steps += 1

    def bytes_sent(self) -> float:
        return float(bytes_sent(self.strategy)) + self.fsdp_bytes * self.steps

    def calls(self) -> int:
        stats = getattr(getattr(self.strategy, "comm", None), "stats", None)
        return int(stats.calls) if stats is not None else 0

    def period(self) -> int:
        """Steps between syncs when the strategy says (``sync=px.every(k)`` or ``every=k``), else 1."""
        for holder in (getattr(self.strategy, "sync", None), self.strategy):
            for name in ("k", "every"):
                value = getattr(holder, name, None)
                if isinstance(value, int) and not isinstance(value, bool) and value >= 1:
                    return value
        return 1

    def extra(self) -> dict[str, Any]:
        """Per-server load (bytes, requests, imbalance) of a parameter-server strategy, as its servers count it."""
        if not hasattr(self.strategy, "table"):
            return {}
        try:
            return {"servers": load_report(self.strategy).as_dict()}
        except Exception as err:  # a report is a nicety; never lose the measurement to it
            return {"servers_error": repr(err)}

    def finish(self) -> None:
        """Leave the servers (a colocated one keeps serving until every worker is done)."""
        finish = getattr(self.strategy, "finish", None)
        if callable(finish):
            finish()


class PeerAccountant(Accountant):
    def __init__(self, grad_bytes: int) -> None:
        self.grad_bytes, self.factor, self.powersgd, self.steps = grad_bytes, 1.0, None, 0

    def count_step(self, *_: Any) -> None:
        self.steps += 1

    def bytes_sent(self) -> float:
        if self.powersgd is not None:  # counts elements itself (after the vanilla first iterations)
            return float(self.powersgd.total_numel_after_compression * 4)
        return self.grad_bytes * self.factor * self.steps

    def calls(self) -> int:
        return 0


def wire_bytes() -> int | None:
    """Bytes sent on this namespace's link interface so far (link runs only)."""
    iface = os.environ.get("PHALANX_BENCH_IFACE")
    if not iface:
        return None
    try:
        with open(f"/sys/class/net/{iface}/statistics/tx_bytes") as f:
            return int(f.read())
    except OSError:
        return None


def peak_rss_bytes() -> int:
    """This process's peak resident set so far, measured by the kernel (``ru_maxrss``, KiB on Linux)."""
    import resource
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def synthetic(shape: tuple[int, ...], classes: int, batch: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(batch, *shape, generator=gen), torch.randint(classes, (batch,), generator=gen))
            for _ in range(POOL)]


def run(cfg: dict[str, Any], clock: Callable[[], float] = time.perf_counter) -> dict[str, Any]:
    """Train ``cfg["warmup"] + cfg["steps"]`` steps and return every raw timing.

    ``clock`` times the steps (a test passes synthetic readings; the probe keeps its own clock).
    """
    threads = int(cfg.get("threads", 1))
    torch.set_num_threads(threads)
    rank = int(os.environ.get("RANK", 0))
    setup = Setup(cfg["setup"]["name"], cfg["setup"].get("kwargs", {}))
    torch.manual_seed(cfg.get("seed", 0))
    model, shape, classes = models.build(cfg["model"])
    opt = torch.optim.SGD(model.parameters(), lr=cfg.get("lr", 0.01), momentum=0.9)
    module, acc = setup_training(setup, model, opt)
    data = synthetic(shape, classes, int(cfg["batch"]), seed=1000 + rank)
    warmup, steps = int(cfg["warmup"]), int(cfg["steps"])
    if dist.is_initialized():
        dist.barrier()  # start the clocks together
    probe = StepProbe(module, opt)
    step_s: list[float] = []
    marks: dict[str, Any] = {}
    probe.mark()
    top = clock()
    for i in range(warmup + steps):
        if i == warmup:
            marks = {"bytes": acc.bytes_sent(), "calls": acc.calls(), "wire": wire_bytes()}
        x, y = data[i % POOL]
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(module(x), y).backward()
        opt.step()
        now = clock()
        step_s.append(now - top)
        top = now
    probe.close()
    wire_end = wire_bytes()
    result = {
        "rank": rank, "world_size": int(os.environ.get("WORLD_SIZE", 1)), "threads": threads,
        "warmup": warmup, "steps": steps, "batch": int(cfg["batch"]), "step_s": step_s, "phases": probe.records,
        "bytes_per_step": (acc.bytes_sent() - marks["bytes"]) / steps if steps else 0.0,
        "calls_per_step": (acc.calls() - marks["calls"]) / steps if steps else 0.0,
        "wire_bytes_per_step": (wire_end - marks["wire"]) / steps if steps and wire_end is not None else None,
        "period": acc.period(), "grad_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
        "params": sum(p.numel() for p in model.parameters()), "extra": acc.extra(),
        "peak_rss_bytes": peak_rss_bytes(),
    }
    acc.finish()
    if dist.is_initialized():
        dist.barrier()
    return result


def main(argv: list[str], fn: Callable[[dict[str, Any]], dict[str, Any]] = run) -> int:
    """``CONFIG.json OUT.json``: run ``fn`` on the config and write its result atomically."""
    with open(argv[0]) as f:
        cfg = json.load(f)
    result = fn(cfg)
    tmp = argv[1] + ".tmp"
    with open(tmp, "w") as f:
        json.dump(result, f)
    os.replace(tmp, argv[1])
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
