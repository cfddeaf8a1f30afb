"""The preemption tests' oracle: tests/workers/preempt.py's model trained by one plain-torch process."""
from __future__ import annotations

import torch

def oracle() -> torch.nn.Module:
    """The worker's model trained by one plain-torch process on the global batches (2 x 4 samples)."""
    from phalanx.data.loader import global_batches
    from workers import preempt as w
    torch.manual_seed(1)
    net = w.make_model()
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    x, y = w.data().tensors
    for epoch in range(w.EPOCHS):
        for parts in global_batches(w.N, 2 * w.BATCH, 1, shuffle=True, seed=0, epoch=epoch):
            idx = torch.tensor(parts[0])
            opt.zero_grad()
            torch.nn.functional.cross_entropy(net(x[idx]), y[idx]).backward()
            opt.step()
    return net


def weights(path: str) -> list[torch.Tensor]:
    return list(torch.load(path, weights_only=True).values())
