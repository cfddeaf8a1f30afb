"""What ``px.Auto``'s probe costs across a shaped link: the figures of docs/strategies.md ("How Auto probes").

    phalanx run -n 2 --link 10mbit benchmarks/auto_probe.py           # as root; 100mbit, 1gbit likewise

The MLP of benchmarks/auto_link.py (790k parameters, AdamW, batch 64 of random data a worker), ``px.Auto(planned_steps
=200)``, 12 steps. Rank 0 prints one line: the probe's wall time (from ``px.wrap`` to the end of the step Auto decides
at: the link probe, the probe steps and their exchange or final average, the chosen rule's attach), the bytes rank 0
sent by then (wrap's broadcast of the model included), the mean step after it, and the probe's cost over that step.
Run it against another checkout's ``src`` (``PYTHONPATH=...``) to compare probes on the same link.
"""
import time

import torch
import torch.nn.functional as F

import phalanx as px


def main() -> None:
    px.init()
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.Tanh(), torch.nn.Linear(1024, 512), torch.nn.Tanh(),
                              torch.nn.Linear(512, 10))
    start = time.perf_counter()
    model, opt = px.wrap(net, torch.optim.AdamW(net.parameters(), lr=1e-3), strategy=px.Auto(planned_steps=200))
    auto = px.strategy_of(opt)
    wrapped = time.perf_counter() - start  # the model's broadcast (and, with the new probe, the link's)
    sent0 = 0  # from the start: the new probe measures the link inside px.wrap (the model's broadcast included)
    gen = torch.Generator().manual_seed(px.rank())
    probe_s = probe_bytes = None
    after: list[float] = []
    for _ in range(12):
        x, y = torch.randn(64, 256, generator=gen), torch.randint(0, 10, (64,), generator=gen)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
        now = time.perf_counter()
        if probe_s is None and auto.choice is not None:
            probe_s, probe_bytes = now - start, auto.comm.stats.bytes_sent - sent0
        elif probe_s is not None:
            after.append(now)
    auto.finish()
    if px.rank() == 0 and probe_s is not None and len(after) > 2:
        step = (after[-1] - after[1]) / (len(after) - 2)  # the first step after the switch excluded (warm-up)
        path = getattr(auto, "probing", "allreduce (the old probe)")
        print(f"auto_probe: path {path}, probe {probe_s:.2f} s (px.wrap {wrapped:.2f} s), "
              f"{probe_bytes:,} bytes sent, {auto.choice.describe()}, then {step * 1e3:.1f} ms/step: "
              f"the probe = {probe_s / step:.1f} steps", flush=True)


if __name__ == "__main__":
    main()
