"""The custom rule in docs/strategies.md (AverageEvery: local SGD in 25 lines) on 2 real gloo workers vs one process."""
from __future__ import annotations

import copy
import os

import pytest
import torch
import torch.nn.functional as F

import phalanx as px
from phalanx.step.protocols import ReplicasAgree
from support.procs import run_workers  # tests/conftest.py puts tests/ on the path
from workers.custom_rule import MARKER, data, doc_rule, net

K, STEPS, BATCH = 3, 7, 4  # 7 steps: two averages at 3 and 6, then finish() averages step 7's local step


def oracle() -> list[torch.Tensor]:
    """Both replicas in one process: rank 0's start, each its own slice and momentum, the mean every K steps."""
    replicas = [net(seed=0), None]
    replicas[1] = copy.deepcopy(replicas[0])
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in replicas]
    x, y = data(STEPS * BATCH * 2)

    def average() -> None:
        with torch.no_grad():
            for a, b in zip(replicas[0].parameters(), replicas[1].parameters(), strict=True):
                a.copy_((a + b) / 2)
                b.copy_(a)

    for s in range(STEPS):
        for r, (m, opt) in enumerate(zip(replicas, opts, strict=True)):
            lo = (s * 2 + r) * BATCH
            opt.zero_grad()
            F.cross_entropy(m(x[lo:lo + BATCH]), y[lo:lo + BATCH]).backward()
            opt.step()
        if (s + 1) % K == 0:
            average()
    average()  # finish(): local steps since the last average
    return [p.detach() for p in replicas[0].parameters()]


def test_the_docs_custom_rule_is_under_30_lines_and_uses_only_the_protocol():
    text = open(os.path.join(os.path.dirname(__file__), "..", "..", "docs", "strategies.md")).read()
    code = text.split(MARKER)[1].split("```python")[1].split("```")[0].strip("\n")
    assert len(code.splitlines()) < 30, len(code.splitlines())
    rule = doc_rule()
    assert issubclass(rule, px.Strategy) and isinstance(rule(3), ReplicasAgree)


@pytest.mark.multiproc
def test_the_docs_custom_rule_on_two_workers_equals_both_replicas_in_one_process():
    ranks = run_workers("workers.custom_rule:average_every", world_size=2, timeout=120, k=K, steps=STEPS,
                        batch=BATCH).results
    want = oracle()
    for r in ranks:
        assert r["steps"] == STEPS and r["agree"] == [(s % K == 0) for s in range(1, STEPS + 1)]
        for got, ref in zip(r["params"], want, strict=True):
            torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-7)
    assert all(torch.equal(a, b) for a, b in zip(ranks[0]["params"], ranks[1]["params"], strict=True))
