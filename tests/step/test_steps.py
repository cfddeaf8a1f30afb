"""One step count: every public step counter reads the framework's StepClock (issue 19).

No processes: a group of one counts steps exactly as every rank of a group does.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

import phalanx as px


def test_every_public_step_count_agrees_after_accumulation_a_skipped_step_and_a_fit():
    torch.manual_seed(0)
    net = torch.nn.Linear(3, 1)
    model, opt = px.wrap(net, torch.optim.SGD(net.parameters(), lr=0.01))
    scaler = torch.amp.GradScaler("cpu")
    state = px.elastic.State(model, opt)  # outside `phalanx run --elastic`: its step is the clock's all the same
    x = torch.randn(4, 3)
    for k in range(3):  # three steps of two micro-batches each; GradScaler skips the second (an inf in its loss)
        opt.zero_grad()
        with px.no_sync(model):
            scaler.scale(model(x).pow(2).mean()).backward()
        loss = model(x).pow(2).mean() * (float("inf") if k == 1 else 1.0)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
    strategy = px.strategy_of(opt)
    strategy.settle()
    assert strategy.steps == 3 and state.step == 3
    # the Trainer goes on from the same count (two more steps), and reports it in its history
    data = torch.utils.data.TensorDataset(torch.randn(8, 3), torch.randn(8, 1))
    trainer = px.Trainer(model, opt, F.mse_loss)
    try:
        history = trainer.fit(data, epochs=1, batch_size=4, progress=False)
    finally:
        px.shutdown()
    assert trainer.step == strategy.steps == state.step == history[-1]["step"] == 5
