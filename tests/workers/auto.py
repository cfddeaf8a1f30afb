"""Workers for tests/strategies/test_auto.py: ``px.Auto`` on real ranks over gloo.

Rank r's batch at step t is drawn from a generator seeded by (r, t), so the one-process oracle in the test
replays exactly what each rank trained on. The decision is forced by a decider of the test's own (what Auto
measures on a loaded machine would make the choice a coin toss); the real one runs in :func:`real`.
"""
from __future__ import annotations

import dataclasses
import os
import time
from typing import Any

import torch
import torch.nn.functional as F

import phalanx as px
from phalanx.strategies.decision import Choice, Decision, Measurement, decide

DILOCO = Choice("diloco", (("every", 3), ("outer_lr", 0.7), ("outer_momentum", 0.9)))
ALLREDUCE = Choice("allreduce")
ALLREDUCE_4BIT = Choice("allreduce", (("quantize", 4),))
STREAMING = Choice("streaming-diloco", (("every", 4), ("fragments", 2), ("overlap", 1), ("quantize", 4),
                                        ("outer_lr", 1.0), ("outer_momentum", 0.0)))


class SlowingAuto(px.Auto):
    """Auto whose link probe (still a real all-reduce) reports a 1 TB/s link slowed ``slow`` times, set by the loop:
    a link whose rate stays put, then falls 10x, whatever the load on the test machine does to a probe of a few
    hundred bytes. Far faster than any step, so the probe's path is AllReduce on every machine (a fixed 1 ms was
    slower than 4x a fast machine's step 1, and that machine's probe would have taken the local path)."""

    slow = 1.0

    def _probe_link(self) -> tuple[int, float]:
        nbytes, _ = super()._probe_link()
        return nbytes, nbytes / 1e12 * self.slow


class SlowLinkAuto(px.Auto):
    """Auto on a (simulated) slow link: its link probe is a real all-reduce whose measured time is replaced by what
    that many bytes take at ``rate`` in the ring model, a measured-rate injection (no sleep, no shaping). 40 B/s
    carries this 332-byte gradient in 8.3 s, as 10 Mbit/s carries a 10 MB one (the GPT's): far above its step."""

    rate = 40.0

    def _probe_link(self) -> tuple[int, float]:
        nbytes, _ = super()._probe_link()
        return nbytes, nbytes / self.rate  # N = 2: the ring moves S


class FastLinkAuto(px.Auto):
    """Auto whose link probe reports a link far faster than its step, so the probe takes the AllReduce path on every
    machine. The real probe's path depends on timing: loopback's all-reduce of a few hundred bytes beside this tiny
    net's step is "slow" on a fast machine, and a test whose oracle replays the AllReduce probe then failed in CI."""

    def _probe_link(self) -> tuple[int, float]:
        nbytes, _ = super()._probe_link()
        return nbytes, nbytes / 1e12


class RecordingAuto(FastLinkAuto):
    """Auto that keeps each rank's weights as they stand when the next rule takes over (before its attach, which
    broadcasts rank 0's): the full average at the commit point must already have made them one model."""

    at_switch: list[list[torch.Tensor]] = []

    def _use(self, choice: Choice, start: int) -> None:
        if self.rule is not None:
            self.at_switch.append([p.detach().clone() for p in self.params])
        super()._use(choice, start)


def net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))


def batch(rank: int, step: int, n: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(n, 6, generator=gen), torch.randint(0, 3, (n,), generator=gen)


class Scripted:
    """A decider that answers from a list, one choice per call, and counts its calls; ``None``: refuse to be asked."""

    def __init__(self, *choices: Choice | None) -> None:
        self.choices, self.calls = list(choices), 0

    def __call__(self, m: Measurement, planned: int | None) -> Decision:
        choice = self.choices[min(self.calls, len(self.choices) - 1)]
        self.calls += 1
        if choice is None:
            raise AssertionError("a resumed Auto measured and decided again instead of following its schedule")
        return Decision(choice, (), m, planned or 0)


def steps(model: torch.nn.Module, opt: torch.optim.Optimizer, first: int, last: int,
          after: Any = lambda step: None) -> None:
    for t in range(first, last + 1):
        x, y = batch(px.rank(), t)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
        after(t)


def params(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in px.unwrap(model).parameters()]


def scripted(tmp: str) -> dict[str, Any]:
    """Measure 3 steps (AllReduce), switch to DiLoCo(every=3), regroup-triggered decision back to AllReduce that
    waits for DiLoCo's next round (step 9); a checkpoint at step 7 (mid-round) is resumed by fresh objects."""
    px.init()
    decider = Scripted(DILOCO, ALLREDUCE)
    auto = FastLinkAuto(planned_steps=12, probe_steps=3, decider=decider)
    model, opt = wrapped(auto)
    seen: dict[str, Any] = {}

    def after(t: int) -> None:
        seen.setdefault("rules", []).append(type(auto.rule).__name__)
        if t == 7:
            px.save_checkpoint(os.path.join(tmp, "ckpt"), model, opt, step=t)
            seen["state_at_7"] = auto.state_dict()["choice"]
            auto.regroup()  # as phalanx.elastic calls it after a rebuild: decide again at the next step

    steps(model, opt, 1, 12, after)
    auto.finish()
    out = {"params": params(model), "schedule": [(s["step"], s["choice"]["rule"]) for s in auto.schedule],
           "rules": seen["rules"], "calls": decider.calls, "lines": [s["line"] for s in auto.schedule],
           "saved_choice": seen["state_at_7"]["rule"]}

    # resume: fresh objects, a decider that must not be asked; the run up to step 12 as before, minus the regroup
    decider2 = Scripted(None)
    auto2 = FastLinkAuto(planned_steps=12, probe_steps=3, decider=decider2)
    model2, opt2 = wrapped(auto2)
    px.load_checkpoint(os.path.join(tmp, "ckpt"), model2, opt2)
    out["resumed_choice"] = auto2.state_dict()["choice"]["rule"]
    out["resumed_start"] = auto2.start
    auto2.regroup()  # the original run regrouped right after the save
    auto2.decider = Scripted(ALLREDUCE)  # what the original decided then
    steps(model2, opt2, 8, 12)
    auto2.finish()
    out["resumed_params"] = params(model2)
    out["resumed_schedule"] = [(s["step"], s["choice"]["rule"]) for s in auto2.schedule]
    out["real"] = real(12)  # the same pair of processes: a third model, Auto's own decision
    out["slowing"] = slowing()
    out["leaving_streaming"] = leaving_streaming()
    out["slow_probe"] = slow_probe()
    out["allreduce_after_local_probe"] = allreduce_after_local_probe()
    out["streaming_after_local_probe"] = streaming_after_local_probe()
    out["compressed"] = compressed()
    out["fast_probe"] = fast_probe()
    return out


def fast_probe() -> dict[str, Any]:
    """The AllReduce probe's measured compute step beside this worker's own step timed with no exchange at all: the
    first is step - waiting, and the work Auto does at step 1 (the path's average, AllReduce's attach) is neither."""
    alone = net()
    opt = torch.optim.SGD(alone.parameters(), lr=0.1)
    times = []
    for t in range(1, 8):
        start = time.perf_counter()
        x, y = batch(px.rank(), t)
        opt.zero_grad()
        F.cross_entropy(alone(x), y).backward()
        opt.step()
        times.append(time.perf_counter() - start)
    auto = FastLinkAuto(planned_steps=100, probe_steps=3, decider=Scripted(ALLREDUCE))
    model, opt = wrapped(auto)
    steps(model, opt, 1, 4)
    auto.finish()
    m = auto.measurement
    return {"probing": auto.probing, "compute_s": m.compute_s, "alone_s": sorted(times)[len(times) // 2],
            "local_s": auto._local_s, "backward_cost_s": m.backward_cost_s}


def compressed() -> dict[str, Any]:
    """The 4-bit all-reduce chosen after a 2-step AllReduce probe: steps 3-8 average 4-bit gradients with error
    feedback; what each rank kept of the rounding (the residual) is read at the end."""
    auto = FastLinkAuto(planned_steps=100, probe_steps=2, decider=Scripted(ALLREDUCE_4BIT))
    model, opt = wrapped(auto)
    steps(model, opt, 1, 8)
    out = {"schedule": [(s["step"], s["choice"]["rule"], s["choice"]["settings"]) for s in auto.schedule],
           "rule": repr(auto.rule), "params": params(model), "line": auto.schedule[0]["line"]}
    auto.finish()
    return out


def slow_probe() -> dict[str, Any]:
    """On a slow link the probe's 3 steps are local (no gradient sent), one average ends it at step 3, then DiLoCo
    (the scripted choice) from there; the bytes this worker sent are read after each step."""
    decider = Scripted(DILOCO)
    auto = SlowLinkAuto(planned_steps=100, probe_steps=3, decider=decider)
    model, opt = wrapped(auto)
    sent = [auto.comm.stats.bytes_sent]
    rules: list[str] = []

    def after(t: int) -> None:
        sent.append(auto.comm.stats.bytes_sent)
        rules.append(type(auto.rule).__name__)

    steps(model, opt, 1, 9, after)
    out = {"params": params(model), "schedule": [(s["step"], s["choice"]["rule"]) for s in auto.schedule],
           "sent": [b - a for a, b in zip(sent, sent[1:])], "rules": rules, "probing": auto.probing,
           "measured": dataclasses.asdict(auto.measurement), "lines": [s["line"] for s in auto.schedule]}
    saved = auto.state_dict()
    auto.finish()
    # a resume: fresh objects take the saved schedule back (the probe's path, the rule, its start), asking no decider
    fresh = SlowLinkAuto(planned_steps=100, probe_steps=3, decider=Scripted(None))
    wrapped(fresh)
    fresh.load_state_dict(saved)
    out["resumed"] = {"probing": fresh.probing, "start": fresh.start, "rule": type(fresh.rule).__name__,
                      "schedule": [(s["step"], s["choice"]["rule"]) for s in fresh.schedule],
                      "link_rate": fresh.link_rate}
    fresh.finish()
    return out


def allreduce_after_local_probe() -> dict[str, Any]:
    """On a slow link the probe's local steps drift apart, momentum buffers too; AllReduce chosen at step 3 then
    steps every replica alike from there. Each rank's parameters and momentum after 6 AllReduce steps."""
    auto = SlowLinkAuto(planned_steps=100, probe_steps=3, decider=Scripted(ALLREDUCE))
    model, opt = wrapped(auto)
    steps(model, opt, 1, 9)
    momentum = [opt.state[p]["momentum_buffer"].clone() for p in px.unwrap(model).parameters()]
    out = {"probing": auto.probing, "schedule": [(s["step"], s["choice"]["rule"]) for s in auto.schedule],
           "params": params(model), "momentum": momentum}
    auto.finish()
    return out


def streaming_after_local_probe() -> dict[str, Any]:
    """Streaming DiLoCo (every=4, 2 fragments, 4-bit) chosen at the end of a local probe: its anchors right after it
    takes over at step 3, the parameters at attach, each rank's replica then, and every rank's weights after
    finish() at step 9 (a fragment in flight, the others local since their last sync)."""
    auto = SlowLinkAuto(planned_steps=100, probe_steps=3, decider=Scripted(STREAMING))
    model, opt = wrapped(auto)
    origin = params(model)
    seen: dict[str, Any] = {}

    def after(t: int) -> None:
        if t == 3:
            seen["anchors"] = [a.clone() for f in auto.rule.fragments for a in f.anchor]
            seen["replica"] = params(model)

    steps(model, opt, 1, 9, after)
    auto.finish()
    return {"origin": origin, **seen, "params": params(model),
            "schedule": [(s["step"], s["choice"]["rule"]) for s in auto.schedule]}


def slowing() -> dict[str, Any]:
    """Rechecks every 4 steps: at step 6 the link is as fast as at step 2 (no decision), at step 10 it is 10x
    slower (decide again; AllReduce's every step is a commit point, so the switch is at once)."""
    decider = Scripted(ALLREDUCE, DILOCO)
    auto = SlowingAuto(planned_steps=100, probe_steps=2, recheck_every=4, decider=decider)
    model, opt = wrapped(auto)
    steps(model, opt, 1, 12, lambda t: setattr(auto, "slow", 10.0 if t >= 9 else 1.0))
    auto.finish()
    return {"schedule": [(s["step"], s["choice"]["rule"]) for s in auto.schedule], "calls": decider.calls,
            "params": params(model)}


def leaving_streaming() -> dict[str, Any]:
    """Streaming DiLoCo from step 2, a regroup after step 6 whose decision is AllReduce: Auto averages every
    fragment fully at step 7 and AllReduce takes over; replicas are one model from there."""
    decider = Scripted(STREAMING, ALLREDUCE)
    auto = RecordingAuto(planned_steps=100, probe_steps=2, decider=decider)
    auto.at_switch = []
    model, opt = wrapped(auto)
    steps(model, opt, 1, 10, lambda t: auto.regroup() if t == 6 else None)
    return {"schedule": [(s["step"], s["choice"]["rule"]) for s in auto.schedule], "params": params(model),
            "at_switch": auto.at_switch[-1]}


def wrapped(strategy: Any, opt: Any = None) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    n = net()
    make = opt or (lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9))
    return px.wrap(n, make(n.parameters()), strategy=strategy)


def real(planned: int) -> dict[str, Any]:
    """The real decision on this machine's loopback: it trains, and every rank ends on the same weights."""
    px.init()
    model, opt = wrapped("auto", lambda ps: torch.optim.AdamW(ps, lr=1e-2))
    auto = px.strategy_of(opt)
    losses = []
    for t in range(1, planned + 1):
        x, y = batch(px.rank(), t % 4)
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        losses.append(float(loss))
    auto.finish()
    m = auto.measurement
    return {"params": params(model), "losses": losses, "schedule": [s["choice"]["rule"] for s in auto.schedule],
            "kind": type(auto).__name__, "measured": dataclasses.asdict(m) if m is not None else None,
            "same_as_decide": decide(m, None).choice.state()["rule"] == auto.choice.rule}
