"""Workers for tests/test_streaming_diloco.py: real processes on gloo, digits data.

``exchanges`` runs on every rank of ``run_workers`` (several experiments share one pair of
processes). Run as a script under ``phalanx run --elastic -n 3`` it is the elastic test's
training loop: a tiny regression, Streaming DiLoCo with an exchange always in flight, a
kill at one step, and each survivor's final weights and anchors written to ``--out``.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
from typing import Any

import torch
import torch.nn.functional as F

import phalanx as px

BATCH = 32  # per worker (digits)


def params_of(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in px.unwrap(model).parameters()]


def train(strategy: px.Strategy, opt: Any, steps: int, *, finish: bool = True) -> dict[str, Any]:
    """``steps`` steps of the digits CNN on this rank's shard from the same start on every rank."""
    from phalanx.bench.models import digits_cnn, load_digits_split

    train_set, _ = load_digits_split()
    torch.manual_seed(0)
    net = digits_cnn()
    model, optimizer = px.wrap(net, opt(net.parameters()), strategy=strategy)
    loader = px.shard(train_set, batch_size=BATCH, seed=0)
    done, epoch = 0, 0
    while done < steps:
        loader.set_epoch(epoch)
        for x, y in loader:
            optimizer.zero_grad()
            F.cross_entropy(model(x), y).backward()
            optimizer.step()
            done += 1
            if done == steps:
                break
        epoch += 1
    out = {"before_finish": params_of(model), "bytes_per_step": strategy.bytes_per_step}
    if finish:
        strategy.finish()
    out["params"] = params_of(model)
    return out


def sgd(ps: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(ps, lr=0.1)


def adamw(ps: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(ps, lr=1e-3)


def exchanges(ckpt_dir: str, steps: int = 10) -> dict[str, Any]:
    """DiLoCo beside StreamingDiLoCo(P=1, τ=0); P=2, τ=1 for the paper's oracle; the quantised exchanges;
    a checkpoint taken with an exchange in flight, resumed in new objects."""
    from phalanx.bench.models import load_digits_split
    from workers.strategies import resume_pair

    px.init()
    out: dict[str, Any] = {}
    train_set, _ = load_digits_split()
    # cut at step 5: fragment 0 was sent at step 4 and lands at step 6, so the checkpoint holds it in flight
    out["resume"] = {name: resume_pair(factory, ckpt_dir, name, train_set, total=8, cut=5) for name, factory in {
        "float": lambda: px.StreamingDiLoCo(every=4, fragments=2, overlap=2),
        "4bit": lambda: px.StreamingDiLoCo(every=4, fragments=2, overlap=2, quantize=4)}.items()}
    out["diloco"] = train(px.DiLoCo(every=3), adamw, steps)
    out["streaming1"] = train(px.StreamingDiLoCo(every=3, fragments=1, overlap=0), adamw, steps)
    paper = px.StreamingDiLoCo(every=4, fragments=2, overlap=1, mixing=0.5)
    out["paper"] = train(paper, sgd, steps, finish=False)
    out["paper_anchor"] = [a.clone() for f in paper.fragments for a in f.anchor]
    out["paper_layout"] = [len(f.params) for f in paper.fragments]
    q4 = px.StreamingDiLoCo(every=4, fragments=2, overlap=1, quantize=4)
    out["q4"] = train(q4, sgd, steps)
    out["q4_anchor"] = [a.clone() for f in q4.fragments for a in f.anchor]
    out["allreduce"] = train(px.AllReduce(), sgd, 4)
    out["allreduce_int8"] = train(px.AllReduce(compression=px.Quantize(8, block=64)), sgd, 4)
    out["diloco_int8"] = train(px.DiLoCo(every=4, compression=px.Quantize(8)), sgd, 8)
    return out


# -- the elastic script -----------------------------------------------------------------------------------------------
N, DIM, EBATCH = 64, 5, 4


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--kill", default="", help="ID@STEP: the worker started as rank ID dies before STEP")
    p.add_argument("--commit-every", type=int, default=3)
    args = p.parse_args()
    me = os.environ.get("PHALANX_ELASTIC_ID", os.environ.get("RANK", "0"))
    victim, _, at = args.kill.partition("@")
    px.init()
    g = torch.Generator().manual_seed(1)
    x = torch.randn(N, DIM, generator=g)
    data = torch.utils.data.TensorDataset(x, x @ torch.randn(DIM, 1, generator=g))
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(DIM, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    # Fragment 1 is sent at steps 2, 6, 10..., fragment 0 at 4, 8...; each lands 2 steps later: one is always
    # in flight, so the commit at step 3 holds fragment 1's exchange, and a kill before step 4 leaves the survivors'
    # fragment-0 exchange of step 4 without its third worker.
    strategy = px.StreamingDiLoCo(every=4, fragments=2, overlap=2)
    model, opt = px.wrap(net, torch.optim.SGD(net.parameters(), lr=0.05), strategy=strategy)
    loader = px.shard(data, batch_size=EBATCH, seed=0)
    state = px.elastic.State(model, opt, loader, commit_every=args.commit_every)
    in_flight_at_commit: list[list[int]] = []

    @px.elastic.run
    def run(state: px.elastic.State) -> None:
        for epoch in range(state.epoch, 2):
            loader.set_epoch(epoch)
            for xb, yb in loader:
                if me == victim and state.step + 1 == int(at) and not state.history:
                    os.kill(os.getpid(), signal.SIGKILL)
                if state.step == args.commit_every and state.step in state.commits and not in_flight_at_commit:
                    in_flight_at_commit.append([f.index for f in strategy.fragments if f.sent_at >= 0])
                opt.zero_grad()
                F.mse_loss(model(xb), yb).backward()
                opt.step()

    run(state)
    strategy.finish()
    with open(os.path.join(args.out, f"worker{me}.json"), "w") as f:
        json.dump({"id": me, "steps": state.step, "world_size": px.world_size(), "history": state.history,
                   "params": [t.tolist() for t in px.unwrap(model).parameters()],
                   "anchors": [a.tolist() for fr in strategy.fragments for a in fr.anchor],
                   "in_flight_at_commit": in_flight_at_commit}, f)


if __name__ == "__main__":
    main()
