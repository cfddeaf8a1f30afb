"""Workers for tests/strategies/test_streaming_diloco.py: real processes on gloo, digits data.

``exchanges`` runs on every rank of ``run_workers`` (several experiments share one pair of
processes). Run as a script under ``phalanx run --elastic -n 3`` it is the elastic tests'
training loop: a tiny regression, Streaming DiLoCo with an exchange always in flight, a
kill at one step (a spare, if any, takes the lost worker's place), and each worker's
replica, anchors, final weights and the sample ids each rank trained on written to
``--out``; :func:`elastic_oracle` replays that record in one process. A joiner at a commit
point (the members do not roll back) is checked by hand, as it needs a process started
after the kill (about a minute on a loaded machine): ``phalanx run -n 3 --elastic
--min-workers 2 --replace tests/workers/streaming.py --out DIR --kill 1@5 --epochs 3
--slow-while-below 3``, then :func:`elastic_oracle` on a worker's record.
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import time
from typing import Any

import torch
import torch.nn.functional as F

import phalanx as px
from support.loop import kill_if_victim, train_steps
from workers.elastic import Record, wait_for_spares  # Record: per step (epoch, world size, each rank's ids)

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
    train_steps(model, optimizer, loader, steps)
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
        "4bit": lambda: px.StreamingDiLoCo(every=4, fragments=2, overlap=2, quantize=4),
        "eager": lambda: px.StreamingDiLoCo(every=4, fragments=2, overlap=2, mixing="eager"),
        "moments": lambda: px.StreamingDiLoCo(every=4, fragments=2, overlap=2, quantize=4, moments=("momentum",)),
        "values": lambda: px.StreamingDiLoCo(every=4, fragments=3, overlap=2, quantize=4, cut="values"),
    }.items()}
    out["diloco"] = train(px.DiLoCo(every=3), adamw, steps)
    out["streaming1"] = train(px.StreamingDiLoCo(every=3, fragments=1, overlap=0), adamw, steps)
    paper = px.StreamingDiLoCo(every=4, fragments=2, overlap=1, mixing=0.5)
    out["paper"] = train(paper, sgd, steps, finish=False)
    out["paper_anchor"] = [a.clone() for f in paper.fragments for a in f.anchor]
    out["paper_layout"] = [len(f.params) for f in paper.fragments]
    values = px.StreamingDiLoCo(every=4, fragments=2, overlap=1, mixing=0.5, cut="values")
    out["values"] = train(values, sgd, steps, finish=False)
    out["values_anchor"] = [a.clone() for f in values.fragments for a in f.anchor]
    out["values_sizes"] = [f.numel for f in values.fragments]
    eager = px.StreamingDiLoCo(every=4, fragments=2, overlap=1, mixing="eager")
    out["eager"] = train(eager, sgd, steps, finish=False)
    out["eager_anchor"] = [a.clone() for f in eager.fragments for a in f.anchor]
    moments = px.StreamingDiLoCo(every=4, fragments=2, overlap=1, mixing=0.5, moments=("momentum",))
    out["moments"] = train(moments, lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9), steps, finish=False)
    out["moments_anchor"] = [a.clone() for f in moments.fragments for a in f.anchor]
    q4 = px.StreamingDiLoCo(every=4, fragments=2, overlap=1, quantize=4)
    out["q4"] = train(q4, sgd, steps)
    out["q4_anchor"] = [a.clone() for f in q4.fragments for a in f.anchor]
    out["allreduce"] = train(px.AllReduce(), sgd, 4)
    out["allreduce_int8"] = train(px.AllReduce(compression=px.Quantize(8, block=64)), sgd, 4)
    out["diloco_int8"] = train(px.DiLoCo(every=4, compression=px.Quantize(8)), sgd, 8)
    return out


# -- the elastic script -----------------------------------------------------------------------------------------------
N, DIM, EBATCH, LR = 64, 5, 4, 0.05
EVERY, FRAGMENTS, OVERLAP = 4, 2, 2  # fragment 1 sent at steps 2, 6, 10...; fragment 0 at 4, 8...; each lands 2 later


def elastic_data() -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(N, DIM, generator=g)
    return torch.utils.data.TensorDataset(x, x @ torch.randn(DIM, 1, generator=g), torch.arange(N))


def elastic_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(DIM, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--kill", default="", help="ID@STEP: the worker started as rank ID dies before STEP")
    p.add_argument("--commit-every", type=int, default=3)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--mixing", default="0.5", help='α, or "eager" (arXiv 2502.12996)')
    p.add_argument("--cut", default="tensors", help='"tensors" or "values" (fragments of equal values)')
    p.add_argument("--slow-while-below", type=int, default=0,
                   help="steps take 1 s while the group is smaller than this (a replacement is starting), 60 s at most")
    args = p.parse_args()
    me = os.environ.get("PHALANX_ELASTIC_ID", os.environ.get("RANK", "0"))
    px.init()
    data, net = elastic_data(), elastic_model()
    # With overlap 2 one exchange is always in flight, so every commit holds one, and a kill leaves the
    # survivors' next exchange without its worker.
    mixing = args.mixing if args.mixing == "eager" else float(args.mixing)
    strategy = px.StreamingDiLoCo(every=EVERY, fragments=FRAGMENTS, overlap=OVERLAP, mixing=mixing, cut=args.cut)
    model, opt = px.wrap(net, torch.optim.SGD(net.parameters(), lr=LR), strategy=strategy)
    loader = px.shard(data, batch_size=EBATCH, seed=0)
    record = Record()
    state = px.elastic.State(model, opt, loader, commit_every=args.commit_every, extra={"record": record})
    comm = px.Comm()
    in_flight: dict[int, list[int]] = {}  # per commit: the fragments with an exchange in flight

    @px.elastic.run
    def run(state: px.elastic.State) -> None:
        for epoch in range(state.epoch, args.epochs):
            loader.set_epoch(epoch)
            for xb, yb, ids in loader:
                # wait until a spare is parked, so that it is hot when the kill comes
                kill_if_victim(state, me, args.kill, first=lambda: wait_for_spares(state))
                if state.step in state.commits and state.step not in in_flight:
                    in_flight[state.step] = [f.index for f in strategy.fragments if f.sent_at >= 0]
                padded = torch.cat([ids, torch.full((EBATCH - len(ids),), -1, dtype=ids.dtype)])
                record.steps.append([epoch, px.world_size(),
                                     [[i for i in part.tolist() if i >= 0] for part in comm.all_gather(padded)]])
                opt.zero_grad()
                F.mse_loss(model(xb), yb).backward()
                opt.step()
                if px.world_size() < args.slow_while_below and time.monotonic() < began + 60:
                    time.sleep(1.0)  # sleep: a slow step while below the world size (the behaviour tested)

    began = time.monotonic()
    run(state)
    replica = [t.tolist() for t in px.unwrap(model).parameters()]
    anchors = [a.tolist() for fr in strategy.fragments for a in fr.anchor]
    strategy.finish()
    with open(os.path.join(args.out, f"worker{me}.json"), "w") as f:
        json.dump({"id": me, "rank": px.rank(), "steps": state.step, "world_size": px.world_size(),
                   "history": state.history, "record": record.steps, "replica": replica, "anchors": anchors,
                   "params": [t.tolist() for t in px.unwrap(model).parameters()],
                   "in_flight": {str(k): v for k, v in in_flight.items()}}, f)


def elastic_oracle(record: list, history: list, mixing: float | str = 0.5, cut: str = "tensors") -> dict[str, Any]:
    """The elastic run in ONE process: each member's replica, Algorithm 1 over the members' weighted mean.

    ``record``: per step, each rank's sample ids; ``history``: the membership changes, each taking effect
    after the commit it names. At a change the lost members' parts of the exchanges in flight are dropped;
    a joiner takes a copy of rank 0's replica and optimizer, sends nothing for those exchanges and counts
    its samples from the join; everyone keeps the anchors and outer momentum. ``mixing="eager"``: at a send
    every member takes the outer step with its own pseudo-gradient; when the average lands a member keeps its
    steps since the send on the new anchor, and a joiner, which holds no stand-in, takes the anchor.
    ``cut="values"``: fragment k holds the values ``[total·k/P, total·(k+1)/P)`` (rounded half up) of the
    concatenated parameters, a tensor split where a cut falls inside it; every update here is elementwise, so each
    fragment is a list of runs of one tensor's flat values.
    """
    from phalanx.strategies.fragments import balanced_split

    data, first = elastic_data(), elastic_model()
    numels = [p.numel() for p in first.parameters()]
    starts = [sum(numels[:i]) for i in range(len(numels) + 1)]
    if cut == "tensors":
        ranges = balanced_split([p.numel() * p.element_size() for p in first.parameters()], FRAGMENTS)
        cuts = [starts[r.start] for r in ranges] + [starts[-1]]
    else:
        cuts = [(starts[-1] * k + FRAGMENTS // 2) // FRAGMENTS for k in range(FRAGMENTS + 1)]
    runs = [(i, max(lo, starts[i]) - starts[i], min(hi, starts[i + 1]) - starts[i]) for lo, hi in zip(cuts, cuts[1:])
            for i in range(len(numels)) if max(lo, starts[i]) < min(hi, starts[i + 1])]
    frags = [[k for k, (i, a, _) in enumerate(runs) if cuts[f] <= starts[i] + a < cuts[f + 1]]
             for f in range(FRAGMENTS)]

    def view(ps: list[torch.Tensor], k: int) -> torch.Tensor:  # run k of these parameters, written through
        i, a, b = runs[k]
        return ps[i] if (a, b) == (0, numels[i]) else ps[i].detach().view(-1)[a:b]

    members = [str(r) for r in range(record[0][1])]
    nets = {m: copy.deepcopy(first) for m in members}
    opts = {m: torch.optim.SGD(nets[m].parameters(), lr=LR) for m in members}
    shares = {m: [0.0] * FRAGMENTS for m in members}
    anchor = [view(list(first.parameters()), k).detach().clone() for k in range(len(runs))]
    momentum = [torch.zeros_like(a) for a in anchor]
    in_flight: dict[int, tuple[int, dict[str, tuple[float, list[torch.Tensor]]]]] = {}
    stand_in: dict[tuple[str, int], torch.Tensor] = {}  # (member, parameter) -> its weights after the eager step
    changes = {h["step"]: h for h in history}
    for t, (_epoch, world, parts) in enumerate(record, start=1):
        if t - 1 in changes:
            change = changes[t - 1]
            members = [m for m in members if m not in change["left"]] + list(change["joined"])
            for j in change["joined"]:
                nets[j] = copy.deepcopy(nets[members[0]])
                opts[j] = torch.optim.SGD(nets[j].parameters(), lr=LR)
                opts[j].load_state_dict(opts[members[0]].state_dict())
                shares[j] = [0.0] * FRAGMENTS
            for _, parts_of in in_flight.values():
                for m in change["left"]:
                    parts_of.pop(m, None)
        assert len(parts) == len(members) == world
        total = sum(len(ids) for ids in parts)
        for m, ids in zip(members, parts, strict=True):
            if ids:
                x, y, _ = data[torch.tensor(ids)]
                opts[m].zero_grad()
                F.mse_loss(nets[m](x), y).backward()
                opts[m].step()
            shares[m] = [s + len(ids) * world / total for s in shares[m]]
        with torch.no_grad():
            weights = {m: [view(list(nets[m].parameters()), k) for k in range(len(runs))] for m in members}
            for p, idx in enumerate(frags):
                if t % EVERY == p * EVERY // FRAGMENTS:
                    in_flight[p] = (t, {m: (shares[m][p], [anchor[i] - weights[m][i] for i in idx]) for m in members})
                    for m in members:
                        shares[m][p] = 0.0
                        for i in idx if mixing == "eager" else ():
                            d = anchor[i] - weights[m][i]
                            stand_in[m, i] = anchor[i] - 0.7 * (d + 0.9 * (0.9 * momentum[i] + d))
                            weights[m][i].copy_(stand_in[m, i])
            for p, idx in enumerate(frags):
                if p in in_flight and t >= in_flight[p][0] + OVERLAP:
                    parts_of = in_flight.pop(p)[1]
                    weight = sum(s for s, _ in parts_of.values())
                    for k, i in enumerate(idx):
                        d = sum(s * delta[k] for s, delta in parts_of.values()) / weight
                        momentum[i].mul_(0.9).add_(d)
                        anchor[i].sub_(d.add(momentum[i], alpha=0.9), alpha=0.7)
                        for m in members:
                            if mixing != "eager":
                                weights[m][i].copy_(torch.lerp(anchor[i], weights[m][i], mixing))
                            elif (m, i) in stand_in:
                                weights[m][i].copy_(anchor[i] + (weights[m][i] - stand_in.pop((m, i))))
                            else:  # a joiner since the send
                                weights[m][i].copy_(anchor[i])
    return {"members": members, "replicas": {m: [p.detach() for p in nets[m].parameters()] for m in members},
            "anchors": anchor}


if __name__ == "__main__":
    main()
