"""The setups compared side by side: torch's own (DDP, its hooks, post-local SGD) and phalanx's.

Every setup gets the task's optimizer family (AdamW for the GPT, SGD with momentum for
ResNet-20) except DiLoCo, whose inner optimizer is AdamW on both tasks, as in the
paper. Periods are the papers' where they fit the budget: local SGD H = 16 (Lin et al.
2020) with a 50-step synchronous warm-up for the post-local variants (the same on both
sides), DiLoCo H = 50 (the paper's smallest), EASGD τ = 4, Downpour push/pull every step
with Adagrad on the servers (Dean et al.), its lr swept from the SGD base.

Example:
    >>> sorted(SETUPS)[:3], SETUPS["diloco"].optim
    (['allreduce', 'allreduce-4bit', 'allreduce-int8'], 'adamw')
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn
from torch.distributed.algorithms.model_averaging import utils as averaging
from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager

from phalanx.bench.spec import Setup
from .curves import COMPUTE_ONLY
from phalanx.bench.worker import PeerAccountant, StrategyAccountant, setup_training
from . import torchft_peer

WARMUP, LOCAL_EVERY, DILOCO_EVERY = 50, 16, 50
# Streaming DiLoCo (arXiv 2501.18512): DiLoCo's H, 4 fragments (one syncs every H/4 = 12 steps), each exchange
# given 5 inner steps to travel (the paper's τ ranges over 1-10; a 4-bit fragment of the GPT is ~40 kB, of the
# larger GPT ~1.6 MB: about 1.3 s at 10 Mbit/s, a few of its steps).
STREAM_FRAGMENTS, STREAM_OVERLAP = 4, 5
# Streamed local SGD: the task's own optimizer, each of 4 fragments averaged every H = 4 steps, so one fragment
# leaves every step and 3 are in flight. On ResNet-20 (loopback, 3 seeds, 2026-11-27) it needed DDP's steps to
# target (144 against 148) where H = 8 needed 160 and H = 16 200: early in training replicas drift apart fast.
STREAM_LOCAL_EVERY, STREAM_OVERLAP_LOCAL = 4, 3
# 4-bit values with one float32 scale per 256: 0.516 bytes a value (per 128: 0.531, 3% more on the wire)
STREAM_BLOCK = 256
# At H the exchange sends 0.516 bytes a value once per H steps where DDP sends 4 every step: 4 H / 0.516 fewer
# bytes, 388x at H = 50. H = 64 (a fragment every 16 steps) is 496x: room above 400x for the headers on the wire.
STREAM_EVERY_SPARSE = 64
# SparseLoCo (2-bit chunked top-k, 64 of 4096): 116 bytes per 4096 values per exchange, 141x fewer than float32; at
# H = 16 that is 2250x fewer bytes than DDP per step by arithmetic (the paper's H is 15 to 50).
SPARSE_EVERY = 16
# px.Auto in the benchmark plans the budget's length (the tasks' budgets are 180-200 steps); on 10-100 Mbit/s it
# then picks Streaming DiLoCo with this period (phalanx.strategies.decision: the longest period a run of 200 steps
# allows, MIN_ROUNDS outer rounds).
AUTO_PLANNED, AUTO_SLOW_EVERY = 200, 64


@dataclass(frozen=True)
class QSetup:
    """One side-by-side entry: who provides it, how it is built, which optimizer family it uses."""

    name: str
    provider: str  # "torch", "torchft" or "phalanx"; "reference" for compute-only (no setup to compare)
    build: Callable[[nn.Module, torch.optim.Optimizer, float], tuple[nn.Module, torch.optim.Optimizer, Any]]
    optim: str | None = None  # None: the task's family; "adamw": always AdamW (DiLoCo)
    note: str = field(default="")
    lr_of: str | None = None  # a variant with no sweep of its own runs at this setup's swept lr


def _peer(name: str, **kwargs: Any):
    def build(model, opt, lr):
        module, acc = setup_training(Setup(name, kwargs), model, opt)
        return module, opt, acc
    return build


def _streamed(every: int, overlap: int, *, averaged: bool = True, **options: Any):
    """The builder of a Streaming DiLoCo setup with 4-bit outer gradients (a float32 scale per STREAM_BLOCK) over
    STREAM_FRAGMENTS fragments; ``averaged``: plain averaging as the outer step (outer lr 1, no momentum)."""
    def make(lr: float) -> Any:
        import phalanx as px

        outer = {"outer_lr": 1.0, "outer_momentum": 0.0} if averaged else {}
        return px.StreamingDiLoCo(every=every, fragments=STREAM_FRAGMENTS, overlap=overlap,
                                  quantize=px.Quantize(4, block=STREAM_BLOCK), **outer, **options)
    return _phalanx(make)


def _phalanx(make: Callable[[float], Any]):
    def build(model, opt, lr):
        import phalanx as px

        px.init()
        strategy = make(lr)
        module, opt2 = px.wrap(model, opt, strategy=strategy)
        return module, opt2, StrategyAccountant(strategy)
    return build


def torch_post_local(warmup: int = WARMUP, every: int = LOCAL_EVERY) -> Callable[..., tuple]:
    """PyTorch's post-local SGD as local SGD: ``post_localSGD_hook``, then ``PostLocalSGDOptimizer``.

    The hook all-reduces gradients for the first ``warmup`` steps and, with
    ``post_local_gradient_allreduce=False``, none after (torch's default, True, would keep
    all-reducing every gradient: synchronous SGD). Torch's averager averages after steps
    ``s`` with ``s - 1 >= warmup_steps`` and ``(s - 1 - warmup_steps) % period == 0``; its
    ``warmup_steps = warmup + every - 1`` makes that steps warmup + every, warmup + 2·every, ...:
    the steps ``px.LocalSGD(every=every, warmup_steps=warmup)`` averages after.
    """
    def build(model: nn.Module, opt: torch.optim.Optimizer, lr: float) -> tuple:
        import torch.distributed as dist
        from torch.distributed.algorithms.ddp_comm_hooks import post_localSGD_hook as plh
        from torch.distributed.optim import PostLocalSGDOptimizer
        from torch.nn.parallel import DistributedDataParallel as DDP

        if not dist.is_initialized():
            dist.init_process_group("gloo")
        ddp = DDP(model)
        acc = _PostLocalAccountant()
        # subgroup=None would make torch split the world into per-GPU-count subgroups, which it refuses without
        # CUDA; the whole world is the group local SGD averages over here.
        state = plh.PostLocalSGDState(process_group=None, subgroup=dist.group.WORLD, start_localSGD_iter=warmup,
                                      post_local_gradient_allreduce=False)
        ddp.register_comm_hook(state, acc.counting_hook)
        wrapped = PostLocalSGDOptimizer(optim=opt, averager=_CountingAverager(every, warmup + every - 1, acc))
        wrapped.optim.register_step_post_hook(acc.count_step)
        return ddp, wrapped, acc
    return build


class _PostLocalAccountant(PeerAccountant):
    """The bytes torch's post-local SGD hands to its all-reduces, counted where it sends them.

    Gradients: each bucket the comm hook all-reduces (the warm-up). Parameters: the one
    flat buffer of each average the averager takes. ``averaged_at`` lists those steps.
    """

    def __init__(self) -> None:
        super().__init__(0)
        self.sent, self.averaged_at = 0, []

    def counting_hook(self, state, bucket):  # noqa: ANN001, ANN201 - DDP checks a hook's annotations against
        # dist.GradBucket itself, and under `from __future__ import annotations` they would be strings
        """torch's post_localSGD_hook; counts the bucket when the hook all-reduces it (its two documented cases)."""
        from torch.distributed.algorithms.ddp_comm_hooks import post_localSGD_hook as plh

        if state.iter < state.start_localSGD_iter or state.post_local_gradient_allreduce:
            buffer = bucket.buffer()
            self.sent += buffer.numel() * buffer.element_size()
        return plh.post_localSGD_hook(state, bucket)

    def bytes_sent(self) -> float:
        return float(self.sent)


class _CountingAverager(PeriodicModelAverager):
    """torch's PeriodicModelAverager, unchanged; counts the buffer of each all-reduce it issues."""

    def __init__(self, period: int, warmup_steps: int, acc: _PostLocalAccountant) -> None:
        super().__init__(period=period, warmup_steps=warmup_steps)
        self.acc = acc

    def average_parameters(self, params: Any) -> None:
        params = list(params)
        flat = list(averaging.get_params_to_average(params))
        before, step = [p.data_ptr() for p in flat], self.step + 1  # its step counts from 0
        super().average_parameters(params)
        # An average all-reduces one flat copy of every parameter and points each parameter into it.
        if flat and [p.data_ptr() for p in flat] != before:
            dtype = functools.reduce(torch.promote_types, (p.dtype for p in flat))
            self.acc.sent += sum(p.numel() for p in flat) * dtype.itemsize
            self.acc.averaged_at.append(step)


def _lever(every: int = AUTO_SLOW_EVERY, fragments: int = 2, overlap: int = 1, quantize: Any = 4, *,
           moments: bool | str = False, lr_scale: float = 1.0, **options: Any):
    """Auto's slow-link pick (``StreamingDiLoCo(every=64, fragments=2, overlap=1, quantize=4)`` with plain averaging
    for a 200-step run) with one lever moved; ``moments``: Adam's two moments (SGD's momentum buffer) averaged too."""
    def build(model, opt, lr):
        import phalanx as px

        px.init()
        for g in opt.param_groups:  # a lever on the inner lr (the user's optimizer): lr_scale x the task's
            g["lr"] *= lr_scale
        adam = isinstance(opt, torch.optim.Adam | torch.optim.AdamW)
        names = ("momentum",) if moments == "first" else ("momentum", "exp_avg_sq") if moments and adam \
            else ("momentum",) if moments else ()
        outer = {"outer_lr": 1.0, "outer_momentum": 0.0, **options}
        strategy = px.StreamingDiLoCo(every=every, fragments=fragments, overlap=overlap,
                                      quantize=quantize() if callable(quantize) else quantize, moments=names, **outer)
        module, opt2 = px.wrap(model, opt, strategy=strategy)
        return module, opt2, StrategyAccountant(strategy)
    return build


def _lever_allreduce(lr_scale: float = 1.0, compression: Any = None):
    """AllReduce (exact gradient averaging) with the task's lr scaled: the reference a lever on the lr is held to;
    ``compression``: a factory of the gradients' compressor (a sparsified all-reduce, DGC-style)."""
    def build(model, opt, lr):
        import phalanx as px

        px.init()
        for g in opt.param_groups:
            g["lr"] *= lr_scale
        strategy = px.AllReduce(compression=compression() if compression is not None else None)
        module, opt2 = px.wrap(model, opt, strategy=strategy)
        return module, opt2, StrategyAccountant(strategy)
    return build


def _lever_diloco(every: int, **options: Any):
    """DiLoCo's blocking exchange in float32 with plain averaging: local Adam/SGD with parameters averaged every k."""
    def build(model, opt, lr):
        import phalanx as px

        px.init()
        strategy = px.DiLoCo(every=every, **{"outer_lr": 1.0, "outer_momentum": 0.0, **options})
        module, opt2 = px.wrap(model, opt, strategy=strategy)
        return module, opt2, StrategyAccountant(strategy)
    return build


def _levers() -> list[QSetup]:
    """The levers of issue 41 on auto's slow-link pick (benchmarks/levers.py measures their steps to target)."""
    import phalanx as px

    base = (f"StreamingDiLoCo(every={AUTO_SLOW_EVERY}, fragments=2, overlap=1, quantize=4, outer_lr=1, "
            "outer_momentum=0): auto's pick on 10-100 Mbit/s for a 200-step run; the task's optimizer at DDP's lr")
    rows = [
        ("lever-base", _lever(), base),
        ("lever-h16", _lever(every=16), "as lever-base with every=16 (4x the bytes)"),
        ("lever-h32", _lever(every=32), "as lever-base with every=32 (2x the bytes)"),
        ("lever-h8", _lever(every=8), "as lever-base with every=8 (8x the bytes)"),
        ("lever-h8-f8v", _lever(every=8, fragments=8, cut="values"),
         "as lever-h8 with 8 fragments of equal values (cut='values': a tensor split between fragments), auto's "
         "pick for the LSTM at 10 Mbit/s: the same bytes, sent an eighth at a time"),
        ("lever-fp32", _lever(quantize=None), "as lever-base sent in float32 (8x the bytes)"),
        ("lever-ef4", _lever(quantize=lambda: px.Quantize(4, error_feedback=True)),
         "as lever-base with 4-bit error feedback: what rounding left out is added to the next exchange"),
        ("lever-lr1.4", _lever(lr_scale=2 ** 0.5), "as lever-base with the inner lr x sqrt(2)"),
        ("lever-lr2", _lever(lr_scale=2.0), "as lever-base with the inner lr x 2"),
        ("lever-ar-lr1.4", _lever_allreduce(2 ** 0.5), "AllReduce (DDP's arithmetic) with the lr x sqrt(2)"),
        ("lever-ar-lr2", _lever_allreduce(2.0), "AllReduce (DDP's arithmetic) with the lr x 2"),
        *((f"lever-ar-topk{r:g}", _lever_allreduce(compression=lambda r=r: px.TopK(r)),
           f"AllReduce of the gradients' top {r:g} share by magnitude, error feedback (what is not sent waits for "
           "the next step): the per-step exchange a slow link carries") for r in (0.01, 0.03)),
        *((f"lever-h{h}-olr1.4", _lever(every=h, outer_lr=2 ** 0.5),
           f"as lever-base with every={h} and outer lr sqrt(2): Adam's step from a half batch carries 1/sqrt(2) of "
           "the full batch's signal") for h in (4, 8, 16, 64)),
        *((f"lever-avg{h}", _lever_diloco(h), f"DiLoCo(every={h}), plain averaging, float32: local steps, the "
           "parameters averaged every {h} steps") for h in (1, 4, 16)),
        ("lever-h4", _lever(every=4), "as lever-base with every=4 (16x the bytes: 30x fewer than DDP)"),
        ("lever-h128", _lever(every=128), "as lever-base with every=128 (half the bytes: ~960x fewer than DDP)"),
        ("lever-h160", _lever(every=160), "as lever-base with every=160 (0.4x the bytes: ~1,200x fewer than DDP)"),
        # Adam's second moment averaged through the 4-bit exchange (lever-moments at H = 64, 16, 8, 4 until c820ec0,
        # when StreamingDiLoCo began refusing it: it diverged at H <= 16) runs only in float32 now:
        ("lever-h16-m1", _lever(every=16, moments="first"),
         "as lever-h16 with only the first moment (Adam's exp_avg, SGD's momentum buffer) averaged"),
        ("lever-h4-m1", _lever(every=4, fragments=4, moments="first"),
         "as lever-h16-m1 with every=4 and 4 fragments (a fragment every step, 16x lever-base's bytes): section "
         "7's -moments setup, overlap 1"),
        ("lever-h16-moments-fp32", _lever(every=16, quantize=None, moments=True),
         "as lever-h16 with Adam's first and second moments (SGD: its momentum) averaged too, sent in float32 (the "
         "second moment spans orders of magnitude a 4-bit block scale flattens)"),
        ("lever-h16-eager", _lever(every=16, mixing="eager"),
         "as lever-h16 with eager mixing (arXiv 2502.12996): the inner step taken during the overlap is kept whole"),
        ("lever-ef", _lever(every=16, quantize=px.SparseLoCo),
         "as lever-h16 with SparseLoCo's error feedback (decay 0.95) in place of the outer momentum: the top 64 of "
         "every 4096 values of the accumulated pseudo-gradient as 2-bit values, outer lr 1"),
        ("lever-ef-h8", _lever(every=8, quantize=px.SparseLoCo), "as lever-ef with every=8 (2x its bytes)"),
        ("lever-ef-k256", _lever(every=16, quantize=lambda: px.SparseLoCo(256)),
         "as lever-ef keeping 256 of every 4096 values (4x its bytes)"),
        ("lever-nesterov", _lever(every=16, outer_lr=0.7, outer_momentum=0.9),
         "as lever-h16 with DiLoCo's Nesterov outer step (outer lr 0.7, momentum 0.9)"),
        ("lever-olr", _lever(every=16, outer_lr=1.3),
         "as lever-h16 with outer lr 1.3 and no momentum (an outer step longer than the average)"),
        ("lever-dilocox", _lever(every=16, fragments=1, overlap=15, mixing="eager"),
         "DiLoCoX's one-outer-step-delayed overlap: one fragment every 16 steps, the exchange landing 15 inner "
         "steps later, the average replacing the worker's own pseudo-gradient (eager) with the inner steps "
         "taken meanwhile kept"),
    ]
    return [QSetup(name, "phalanx", build, lr_of="ddp", note=note) for name, build, note in rows]


def _make() -> dict[str, QSetup]:
    import phalanx as px
    from phalanx.ps.optim import Adagrad

    s = [
        QSetup(COMPUTE_ONLY, "reference", _peer("plain"), lr_of="ddp",
               note="not a setup to compare: each worker trains its own replica with no exchange at all; its step "
                    "time, measured beside the other worker, is the compute-only bound's step"),
        QSetup("ddp", "torch", _peer("ddp")),
        QSetup("ddp-fp16", "torch", _peer("ddp-fp16")),
        QSetup("ddp-powersgd", "torch", _peer("ddp-powersgd", rank=4)),
        QSetup("torch-post-local-sgd", "torch", torch_post_local(),
               note=f"post_localSGD_hook(start_localSGD_iter={WARMUP}, post_local_gradient_allreduce=False) + "
                    f"PostLocalSGDOptimizer + PeriodicModelAverager(period={LOCAL_EVERY}, "
                    f"warmup_steps={WARMUP + LOCAL_EVERY - 1}): averages after the steps px.LocalSGD does"),
        QSetup("allreduce", "phalanx", _phalanx(lambda lr: px.AllReduce())),
        QSetup("fp16", "phalanx", _phalanx(lambda lr: px.AllReduce(compression=px.FP16()))),
        QSetup("powersgd", "phalanx", _phalanx(lambda lr: px.AllReduce(compression=px.PowerSGD(rank=4)))),
        QSetup("topk", "phalanx", _phalanx(lambda lr: px.AllReduce(compression=px.TopK(0.01)))),
        QSetup("allreduce-int8", "phalanx", _phalanx(lambda lr: px.AllReduce(compression=px.Quantize(
            8, block=STREAM_BLOCK))), lr_of="ddp",
               note=f"gradients as int8 with a float32 scale per {STREAM_BLOCK}, each bucket all-gathered as "
                    "backward produces it; at DDP's lr"),
        QSetup("allreduce-4bit", "phalanx", _phalanx(lambda lr: px.AllReduce(compression=px.Quantize(
            4, block=STREAM_BLOCK, error_feedback=True))), lr_of="ddp",
               note=f"gradients as packed 4-bit values with a float32 scale per {STREAM_BLOCK} and error "
                    "feedback, each bucket all-gathered as backward produces it; at DDP's lr"),
        QSetup("local-sgd", "phalanx", _phalanx(lambda lr: px.LocalSGD(every=LOCAL_EVERY))),
        QSetup("post-local-sgd", "phalanx",
               _phalanx(lambda lr: px.LocalSGD(every=LOCAL_EVERY, warmup_steps=WARMUP))),
        QSetup("diloco", "phalanx", _phalanx(lambda lr: px.DiLoCo(every=DILOCO_EVERY)), optim="adamw",
               note=f"H={DILOCO_EVERY}, AdamW inner, Nesterov outer lr 0.7 momentum 0.9"),
        QSetup("streaming-diloco", "phalanx", _phalanx(lambda lr: px.StreamingDiLoCo(
            every=DILOCO_EVERY, fragments=STREAM_FRAGMENTS, overlap=STREAM_OVERLAP)), optim="adamw",
               note=f"H={DILOCO_EVERY}, P={STREAM_FRAGMENTS} fragments, overlap τ={STREAM_OVERLAP}, mixing 0.5, "
                    "AdamW inner, Nesterov outer lr 0.7 momentum 0.9, float32 exchange"),
        QSetup("streaming-diloco-4bit", "phalanx", _streamed(DILOCO_EVERY, STREAM_OVERLAP, averaged=False),
               optim="adamw",
               note=f"as streaming-diloco, outer gradients as packed 4-bit values with a float32 scale per "
                    f"{STREAM_BLOCK} (px.Quantize(4, block={STREAM_BLOCK})), all-gathered"),
        QSetup("streaming-diloco-4bit-h16", "phalanx", _streamed(16, 3, averaged=False),
               optim="adamw", lr_of="streaming-diloco-4bit",
               note="as streaming-diloco-4bit with H=16 (a fragment every 4 steps) and τ=3: 3x the bytes of H=50, "
                    "fewer local steps between a fragment's syncs"),
        QSetup("streaming-diloco-4bit-avg", "phalanx", _streamed(DILOCO_EVERY, STREAM_OVERLAP),
               optim="adamw", lr_of="streaming-diloco-4bit",
               note="as streaming-diloco-4bit with plain averaging as the outer step (outer lr 1, no momentum): "
                    "a short run takes few outer steps per fragment (3-4 in the GPT's 180), too few for momentum"),
        QSetup("streaming-diloco-4bit-avg-h64", "phalanx", _streamed(STREAM_EVERY_SPARSE, STREAM_OVERLAP),
               optim="adamw", lr_of="streaming-diloco-4bit",
               note=f"as streaming-diloco-4bit-avg with H={STREAM_EVERY_SPARSE} (a fragment every "
                    f"{STREAM_EVERY_SPARSE // STREAM_FRAGMENTS} steps): 4 x {STREAM_EVERY_SPARSE} / 0.516 = "
                    f"{4 * STREAM_EVERY_SPARSE / (0.5 + 4 / STREAM_BLOCK):.0f}x fewer bytes than DDP by arithmetic"),
        QSetup("streaming-local-sgd-4bit", "phalanx", _streamed(STREAM_LOCAL_EVERY, STREAM_OVERLAP_LOCAL), lr_of="ddp",
               note=f"local SGD streamed: the task's own optimizer (SGD with momentum on ResNet-20, AdamW on the "
                    f"GPTs) at its own swept lr (the GPT: 0.002, twice DDP's) or else DDP's, each of "
                    f"{STREAM_FRAGMENTS} fragments averaged every H={STREAM_LOCAL_EVERY} "
                    f"steps (one fragment leaves every step), as 4-bit values sent while {STREAM_OVERLAP_LOCAL} "
                    f"inner steps go on: 4 x {STREAM_LOCAL_EVERY} / 0.516 = "
                    f"{4 * STREAM_LOCAL_EVERY / (0.5 + 4 / STREAM_BLOCK):.0f}x fewer bytes than DDP by arithmetic"),
        QSetup("streaming-local-sgd-4bit-eager", "phalanx",
               _streamed(STREAM_LOCAL_EVERY, STREAM_OVERLAP_LOCAL, mixing="eager"),
               lr_of="streaming-local-sgd-4bit",
               note="as streaming-local-sgd-4bit with eager updates (arXiv 2502.12996): the average replaces this "
                    "worker's own pseudo-gradient when it lands, and the inner steps taken meanwhile are kept whole"),
        QSetup("streaming-diloco-4bit-eager-h64", "phalanx",
               _streamed(STREAM_EVERY_SPARSE, STREAM_OVERLAP, mixing="eager"),
               optim="adamw", lr_of="streaming-diloco-4bit",
               note="as streaming-diloco-4bit-avg-h64 with eager updates (arXiv 2502.12996): the average replaces "
                    "this worker's own pseudo-gradient when it lands, and the inner steps taken meanwhile are kept"),
        QSetup("streaming-local-sgd-4bit-moments", "phalanx", _streamed(STREAM_LOCAL_EVERY, 1, moments=("momentum",)),
               lr_of="streaming-local-sgd-4bit",
               note="as streaming-local-sgd-4bit with the inner optimizer's momentum (AdamW's exp_avg, SGD's "
                    "momentum buffer) averaged with each fragment in the same 4-bit message (DES-LOC, arXiv "
                    "2505.22549), landing 1 step after the send (τ=1): twice the bytes, 16x fewer than DDP"),
        QSetup("diloco-sparseloco", "phalanx", _phalanx(lambda lr: px.DiLoCo(every=SPARSE_EVERY,
                                                                           compression=px.SparseLoCo())),
               optim="adamw", lr_of="diloco",
               note=f"SparseLoCo (arXiv 2508.15706): DiLoCo H={SPARSE_EVERY}, AdamW inner, the pseudo-gradient's "
                    "top 64 of every 4096 values (plus the residual) as 2-bit values, error feedback (decay 0.95) "
                    "in place of the outer momentum, outer lr 1; on the GPT at inner lr 0.002 (lrs.json: at DiLoCo's "
                    "0.001 the sparse anchor lags and 0/3 seeds reached the target)"),
        QSetup("streaming-diloco-sparseloco", "phalanx", _phalanx(lambda lr: px.StreamingDiLoCo(
            every=SPARSE_EVERY, fragments=STREAM_FRAGMENTS, overlap=3, quantize=px.SparseLoCo())),
               optim="adamw", lr_of="diloco-sparseloco",
               note=f"as diloco-sparseloco, streamed: {STREAM_FRAGMENTS} fragments (one leaves every "
                    f"{SPARSE_EVERY // STREAM_FRAGMENTS} steps), each exchange given 3 inner steps, mixing 0.5"),
        QSetup("auto", "phalanx", _phalanx(lambda lr: px.Auto(planned_steps=AUTO_PLANNED)), lr_of="ddp",
               note=f"px.Auto(planned_steps={AUTO_PLANNED}): measures the step and the link over its first steps "
                    "(AllReduce), then trains with the rule and settings it projects fastest to the target; the "
                    "task's own optimizer at DDP's lr"),
        *_levers(),
        QSetup("torchft-diloco", "torchft", torchft_peer.build(streaming=False), optim="adamw",
               note=f"torchft 0.2.0 DiLoCo, H={torchft_peer.H}, AdamW inner, Nesterov outer lr 0.7 momentum 0.9; "
                    "lighthouse in rank 0's namespace (bench/quality/torchft_peer.py)"),
        QSetup("torchft-streaming-diloco", "torchft", torchft_peer.build(streaming=True), optim="adamw",
               note=f"torchft 0.2.0 Streaming DiLoCo, H={torchft_peer.STREAM_H} (torchft needs H divisible by P), "
                    f"P={torchft_peer.STREAM_FRAGMENTS} fragments cut as phalanx's, τ={torchft_peer.STREAM_OVERLAP}, "
                    f"α={torchft_peer.STREAM_MIXING}, float32 exchange (its quantisation needs triton/CUDA)"),
        QSetup("torchft-streaming-diloco-avg", "torchft", torchft_peer.build(streaming=True, outer_lr=1.0,
                                                                           outer_momentum=0.0),
               optim="adamw", lr_of="torchft-streaming-diloco",
               note="as torchft-streaming-diloco with plain averaging as the outer step (outer lr 1, no momentum), "
                    "as streaming-diloco-4bit-avg"),
        QSetup("easgd", "phalanx", _phalanx(lambda lr: px.EASGD(every=4))),
        QSetup("downpour", "phalanx", _phalanx(lambda lr: px.Downpour(server_optimizer=Adagrad(lr))), optim="sgd",
               note="push/pull every step; Adagrad on the servers at the swept lr (from the SGD base lr)"),
    ]
    return {q.name: q for q in s}


SETUPS: dict[str, QSetup] = _make()


def peer_reasons() -> dict[str, str]:
    """The peers left out of this run, each with the reason (torchft's setups when torchft is not importable)."""
    why = torchft_peer.missing()
    return {name: why for name in torchft_peer.NAMES} if why else {}
