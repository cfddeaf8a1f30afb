"""AllReduce with px.Quantize: each bucket quantised and sent while backward runs (2 real workers, gloo).

The oracle replays every step in one process: both ranks' gradients at the weights the workers held, cut into
the workers' buckets, quantised with error feedback and averaged in rank order.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from support.procs import run_workers
from workers import quantised as w


@pytest.fixture(scope="module")
def runs() -> list[dict]:
    return run_workers("workers.quantised:overlapped", world_size=2, timeout=180).results


def oracle_grads(weights: list[torch.Tensor], buckets: list[list[int]], step: int,
                 compressors: list) -> list[torch.Tensor]:
    """The mean the exchange computes at ``step`` from both ranks' gradients at ``weights``."""
    grads = []
    for rank in (0, 1):
        net = w.mlp()
        with torch.no_grad():
            for p, v in zip(net.parameters(), weights, strict=True):
                p.copy_(v)
        x, y = w.batch(rank, step)
        F.mse_loss(net(x), y).backward()
        grads.append([p.grad for p in net.parameters()])
    out: list[torch.Tensor | None] = [None] * len(weights)
    for k, members in enumerate(buckets):
        flats = [torch.cat([grads[r][i].reshape(-1) for i in members]) for r in (0, 1)]
        messages = [compressors[r].encode(flats[r], f"bucket{k}") for r in (0, 1)]
        mean = compressors[0].sum_messages(messages, flats[0].numel())
        offset = 0
        for i in members:
            n = weights[i].numel()
            out[i] = mean[offset:offset + n].view_as(weights[i])
            offset += n
    return out


@pytest.mark.multiproc
def test_every_rank_holds_the_mean_of_the_quantised_buckets_step_after_step(runs):
    r0, r1 = runs
    compressors = [w.compressor(), w.compressor()]  # their residuals carry from step to step, as the workers'
    for step in range(w.STEPS):
        for a, b in zip(r0["steps"][step]["grads"], r1["steps"][step]["grads"], strict=True):
            assert torch.equal(a, b)  # the same bits on every rank: messages are added in rank order
        want = oracle_grads(r0["steps"][step]["weights"], r0["buckets"], step, compressors)
        for got, exp in zip(r0["steps"][step]["grads"], want, strict=True):
            torch.testing.assert_close(got, exp, rtol=0, atol=1e-6)


@pytest.mark.multiproc
def test_early_buckets_are_sent_before_backward_reaches_the_first_layer(runs):
    buckets = len(runs[0]["buckets"])
    assert buckets >= 3
    for r in runs:
        for s in r["steps"]:
            assert s["events"].count("send") == buckets
            # the bucket holding the first layer goes out as its gradient lands (before the test's own hook on it);
            # every other bucket was on its way while backward was still running
            assert s["events"].index("last grad") == buckets, s["events"]


@pytest.mark.multiproc
def test_bytes_sent_are_the_quantised_messages_and_the_exact_flags(runs):
    q = w.compressor()
    params = list(w.mlp().parameters())
    messages = sum(q.message_bytes(sum(params[i].numel() for i in b)) for b in runs[0]["buckets"])
    flags = 4 * len(params)
    for r in runs:
        for s in r["steps"]:
            assert s["bytes"] == messages + flags
    dense = 4 * sum(p.numel() for p in params)
    assert messages + flags < dense / 6  # 4 bits and a float32 scale per 64 against 32 bits
