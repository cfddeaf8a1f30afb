"""px.Auto across a shaped link: the figures of docs/strategies.md ("Auto") and docs/launching.md (``--link``).

    sudo phalanx run -n 2 --link 100mbit benchmarks/auto_link.py            # or 10mbit, 1gbit

A 3-layer MLP (790k parameters, AdamW, batch 64 of random data a worker), ``px.Auto(planned_steps=200)``, 40 steps:
rank 0 prints Auto's choice, the launcher the step split and the bytes on the wire.
"""
import torch
import torch.nn.functional as F

import phalanx as px


def main() -> None:
    px.init()
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.Tanh(), torch.nn.Linear(1024, 512), torch.nn.Tanh(),
                              torch.nn.Linear(512, 10))
    model, opt = px.wrap(net, torch.optim.AdamW(net.parameters(), lr=1e-3), strategy=px.Auto(planned_steps=200))
    gen = torch.Generator().manual_seed(px.rank())
    for _ in range(40):
        x, y = torch.randn(64, 256, generator=gen), torch.randint(0, 10, (64,), generator=gen)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    px.strategy_of(opt).finish()


if __name__ == "__main__":
    main()
