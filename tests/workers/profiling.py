"""Worker functions for tests/step/test_profiling.py: a timeline recorded while `phalanx bench`'s probe times the steps.

Started with PHALANX_PROFILE set, as `phalanx run --profile DIR` starts workers: px.wrap starts the
timeline (default window: 5 steps skipped, 3 recorded), and the loop itself never mentions it.
"""
from __future__ import annotations

import json
import os
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import phalanx as px
from phalanx.bench.breakdown import StepProbe
from phalanx.step.profiling import TOP_LEVEL

SKIP, STEPS, TOTAL = 5, 3, 10  # px.profile's defaults; the files are written at the step after the window


def timeline(width: int) -> dict[str, Any]:
    px.init()
    torch.manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(64 * TOTAL, width), torch.randint(0, 10, (64 * TOTAL,)))
    net = nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 10))
    model, opt = px.wrap(net, torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9))
    probe = StepProbe(model, opt)
    loader = px.shard(data, batch_size=32, seed=0)
    probe.mark()
    for x, y in loader:
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    probe.close()
    window = probe.records[SKIP:SKIP + STEPS]
    directory = os.environ["PHALANX_PROFILE"]
    mine = json.load(open(os.path.join(directory, f"rank{px.rank()}.json")))
    events = [e for e in mine["traceEvents"] if e.get("ph") == "X" and e.get("pid") == os.getpid()]
    spans: dict[str, float] = {}
    per_step = [0.0] * STEPS  # a step's spans: those that begin before its optimizer step ends
    ends = sorted(e["ts"] + e["dur"] for e in events if e["name"] == "phalanx/optimizer step")[-STEPS:]
    for e in events:
        if e["name"] in TOP_LEVEL:
            spans[e["name"]] = spans.get(e["name"], 0.0) + e["dur"] / 1e6
            k = min(sum(end <= e["ts"] for end in ends), STEPS - 1)  # the window's closing barrier: its last step
            per_step[k] += e["dur"] / 1e6
    out = {"spans": spans, "per_step": per_step, "step_s": [r["step_s"] for r in window], "probe": window,
           "names": sorted({e["name"] for e in events if e["name"].startswith("phalanx/")})}
    px.shutdown()
    return out
