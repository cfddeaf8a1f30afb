"""What ``px.Auto``'s probe measures, apart from what it decides: the link's rate, the compute step and the waiting
of the probe's window, one worker's quantising time, every figure agreed on every rank, and the average of the drift
that ends a probe whose replicas stepped apart.

Each function takes the group's ``comm`` and the trainable parameters; none keeps state (``px.Auto`` keeps the
probe's samples and path, :mod:`phalanx.strategies.auto`). :func:`phalanx.strategies.decision.decide` reads the
:class:`~phalanx.strategies.decision.Measurement` they build.

Example (a group of one: the agreement is the value itself):
    >>> import torch, phalanx as px
    >>> net = torch.nn.Linear(4, 2)
    >>> _ = px.wrap(net, torch.optim.SGD(net.parameters(), lr=0.1))
    >>> agreed(px.Comm(), [0.25, 3.0])
    [0.25, 3.0]
    >>> measurement(list(net.parameters()), 1, compute_s=0.05, rate=1.25e6).sizes
    (8, 2)
"""
from __future__ import annotations

import dataclasses
import time
from typing import Any, Sequence

import torch
from torch import nn

from ..group.collectives import Comm
from .decision import GRAD_BITS, GRAD_BLOCK, PROBE_BYTES, Measurement
from .penalties import ADAPTIVE, SGD
from .quantize import Quantize

#: The bits the local probe's closing average sends each replica's drift in (blocks of 128: Streaming DiLoCo's own).
PROBE_BITS = 4


def agreed(comm: Comm, values: list[float]) -> list[float]:
    """The ranks' mean of ``values``, bit for bit the same everywhere (every rank then decides alike)."""
    vals = torch.tensor(values, dtype=torch.float64)
    comm.all_reduce_([vals])
    comm.broadcast_([vals])
    return vals.tolist()


#: Torch's optimizers that scale each coordinate by a running mean of its squared gradient (or its sum): the
#: penalties of :data:`~phalanx.strategies.decision.ADAPTIVE`. A subclass counts as its base.
ADAPTIVE_OPTIMIZERS: tuple[type, ...] = tuple(getattr(torch.optim, name) for name in (
    "Adam", "AdamW", "NAdam", "RAdam", "Adamax", "Adagrad", "Adadelta", "RMSprop", "SparseAdam", "Adafactor")
    if hasattr(torch.optim, name))


def inner_kind(optimizer: torch.optim.Optimizer | None) -> str:
    """The inner optimizer's kind as the penalties tell it apart: ``"adaptive"``, ``"sgd"``, or ``""`` (neither,
    or not known: the worst family's penalties). By its class, so reading it sends nothing and costs nothing.

    Example:
        >>> net = torch.nn.Linear(2, 1)
        >>> inner_kind(torch.optim.AdamW(net.parameters())), inner_kind(torch.optim.SGD(net.parameters(), lr=0.1))
        ('adaptive', 'sgd')
        >>> inner_kind(torch.optim.LBFGS(net.parameters()))
        ''
    """
    if isinstance(optimizer, ADAPTIVE_OPTIMIZERS):
        return ADAPTIVE
    return SGD if isinstance(optimizer, torch.optim.SGD) else ""


def measurement(params: Sequence[torch.Tensor], workers: int, *, compute_s: float, rate: float,
                overlap: float = 0.0, inner: str = "") -> Measurement:
    """A measurement of these parameters (their bytes and sizes) in a group of ``workers``, trained by an inner
    optimizer of kind ``inner`` (:func:`inner_kind`)."""
    return Measurement(compute_s=max(compute_s, 1e-6), grad_bytes=4.0 * sum(p.numel() for p in params),
                       rate=rate, overlap=overlap, workers=workers, sizes=tuple(p.numel() for p in params),
                       inner=inner)


def saved_measurement(params: Sequence[torch.Tensor], saved: dict[str, Any]) -> Measurement:
    """A checkpoint's measurement; one written before ``sizes`` (it kept a count of tensors) takes the model's."""
    fields = {k: v for k, v in saved.items() if k != "tensors"}
    fields["sizes"] = tuple(int(x) for x in fields.get("sizes", (p.numel() for p in params)))
    return Measurement(**fields)


def window_measurement(comm: Comm, params: Sequence[torch.Tensor], window: list[tuple[float, float]], *,
                       local: bool, local_s: float | None, rate: float, inner: str = "") -> Measurement:
    """The probe window's step and waiting (agreed on every rank), at the rate the first link probe measured.

    ``window``: (time, the clock's waiting so far) after each probe step. ``local``: nothing was sent, so the whole
    step is compute (the clock's waiting then counts the gap from a gradient hook of the step before, not an
    exchange), and the overlap is taken as 0 (it hides at most ``t_c`` of a full all-reduce that takes longer).
    ``local_s``: a fast link's step 2, timed with nothing sent: the AllReduce window starts after it. ``inner``:
    the inner optimizer's kind (:func:`inner_kind`, the same class on every rank)."""
    timed = local_s is not None and not local
    window = window[1:] if timed and len(window) > 2 else window
    (t0, w0), (t1, w1) = window[0], window[-1]
    k = len(window) - 1
    step_s, waited, quantize_s = agreed(comm, [(t1 - t0) / k, 0.0 if local else (w1 - w0) / k,
                                               time_quantize(params)])
    # AllReduce's step less its waiting is the compute step plus what the all-reduce overlapped with backward
    # costs it (hooks, copies, gloo's threads on the cores that train): the compute step of every other rule is
    # the local step 2 where it was timed
    compute_s = min(local_s, step_s - waited) if timed and local_s is not None else step_s - waited
    m = dataclasses.replace(measurement(params, comm.world_size, compute_s=compute_s, rate=rate, inner=inner),
                            quantize_s=quantize_s, backward_cost_s=0.0 if local else step_s - waited - compute_s)
    if local:
        return m
    full = m.ring_s(m.grad_bytes)
    overlap = min(1.0, max(0.0, 1 - waited / full)) if full > 0 else 1.0
    return dataclasses.replace(m, overlap=overlap)


def time_quantize(params: Sequence[torch.Tensor]) -> float:
    """This worker's time to quantise its gradient to 4 bits and back, once: what the compressed all-reduce adds
    to a step on the cores that train. Timed on at most 4M values (linear beyond), sent nowhere."""
    n = sum(p.numel() for p in params)
    chunk = max(1, min(n, 1 << 22))
    x = torch.linspace(-1.0, 1.0, chunk, device=params[0].device)
    q = Quantize(bits=GRAD_BITS, block=GRAD_BLOCK)
    q.decompress(*q.compress(x[:GRAD_BLOCK]))  # the first call's one-off costs are not a step's
    start = time.perf_counter()
    q.decompress(*q.compress(x))
    return (time.perf_counter() - start) * n / chunk


def probe_link(comm: Comm, params: Sequence[torch.Tensor]) -> tuple[int, float]:
    """One timed all-reduce of up to 1 MiB (the gradient's size if smaller): its bytes and seconds."""
    n = max(1, min(int(4 * sum(p.numel() for p in params)), PROBE_BYTES) // 4)
    buf = torch.ones(n, dtype=torch.float32, device=params[0].device)
    comm.all_reduce_([buf[:1]])  # both ranks at the probe: the timing starts together
    start = time.perf_counter()
    comm.all_reduce_([buf])
    return 4 * n, time.perf_counter() - start


def ring_rate(comm: Comm, probe_bytes: int, probe_s: float) -> float:
    """The rate in the ring model from one probe's bytes and its time agreed on every rank."""
    (probe_s,) = agreed(comm, [probe_s])
    n = comm.world_size
    return (0.0 if n <= 1 else 2 * (n - 1) / n * probe_bytes) / max(probe_s, 1e-9)


def average_parameters(comm: Comm, params: Sequence[torch.Tensor], model: nn.Module) -> None:
    """The replicas' mean of the parameters and of the model's floating buffers, in float32."""
    with torch.no_grad():
        comm.all_reduce_([p.data for p in params] + [b for b in model.buffers() if b.is_floating_point()])


def average_drift(comm: Comm, params: Sequence[torch.Tensor], model: nn.Module,
                  origin: list[torch.Tensor] | None) -> None:
    """Every replica the replicas' mean, from each one's drift since ``origin`` (identical on every rank) sent in
    :data:`PROBE_BITS` bits: every rank adds the same mean to the same origin, so they end identical to the bit.
    In float32 where that sends less (many workers: an all-gather grows with them) or there is no origin (a resume
    or a regroup inside the probe, a sharded model)."""
    n, workers, quantize = sum(p.numel() for p in params), comm.world_size, Quantize(bits=PROBE_BITS)
    if origin is None or (workers - 1) * quantize.message_bytes(n) >= 2 * (workers - 1) / workers * 4 * n:
        average_parameters(comm, params, model)
        return
    with torch.no_grad():
        drift = [p.data - o for p, o in zip(params, origin, strict=True)]
        quantize.average_(drift, comm, key="auto probe")  # the same bits on every rank
        for p, o, d in zip(params, origin, drift, strict=True):
            p.data.copy_(o.add_(d))
        buffers = [b for b in model.buffers() if b.is_floating_point()]
        if buffers:
            comm.all_reduce_(buffers)


__all__ = ["ADAPTIVE_OPTIMIZERS", "PROBE_BITS", "agreed", "average_drift", "average_parameters", "inner_kind",
           "measurement", "probe_link", "ring_rate", "saved_measurement", "time_quantize", "window_measurement"]
