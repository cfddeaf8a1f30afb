"""What one quality benchmark runs: the runs, their configs, the presets and the duration estimate.

Example:
    >>> runs = main_runs(["gpt"], ["ddp", "diloco"], ["100mbit"], lrs={}, budgets={"gpt": 30.0})
    >>> [r.title for r in runs]
    ['gpt ddp 2x1 100mbit lr=0.002', 'gpt diloco 2x1 100mbit lr=0.002']
    >>> round(estimate_s(runs, repeats=3) / 60, 1)
    3.5
    >>> [s for s in setups_for("1gbit", list(ALL_SETUPS))] == list(FAST_SETUPS)
    True
"""
from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from typing import Any

from .setups import SETUPS
from .tasks import get
from .torchft_peer import NAMES as TORCHFT

# Per run, beyond its training budget, in a persistent session: evaluations, model/optimizer/strategy rebuild,
# the end-of-run barrier and finish(). Measured under load (an upper bound): see docs/performance.md.
OVERHEAD_S = 3.5
SESSION_S = 12.0  # per session (one per link): two interpreters importing torch, the group's rendezvous
ALL_SETUPS = ("ddp", "ddp-fp16", "ddp-powersgd", "torch-post-local-sgd", "allreduce", "fp16", "powersgd", "topk",
              "local-sgd", "post-local-sgd", "diloco", "streaming-diloco", "streaming-diloco-4bit", "easgd", "downpour")
SWEEP = (0.5, 1.0, 2.0)  # multipliers of the family's base lr, the same for every setup
# On links of 1 Gbit/s and faster only these run: the 1 Gbit target compares phalanx's best with DDP's best
# setting, and communication there is a small share of a step, so the setups built to send less (TopK, EASGD,
# Downpour, the post-local variants) have nothing to win; they all run on the slow link.
FAST_SETUPS = ("ddp", "ddp-fp16", "ddp-powersgd", "allreduce", "fp16", "local-sgd", "diloco")
FAST_BITS = 1e9
# On links slower than SLOW_BITS (10 Mbit/s) a step of DDP on the GPT costs seconds: only DDP (the reference whose
# miss gives a lower bound), the best low-communication setups of the 100 Mbit/s runs, Streaming DiLoCo and the
# 4-bit all-reduce (7.8x fewer bytes than DDP, sent during backward) run.
SLOW_SETUPS = ("ddp", "diloco", "streaming-diloco-4bit", "torchft-streaming-diloco",  # torchft: only when importable
               "streaming-diloco-4bit-avg", "streaming-diloco-4bit-avg-h64", "torchft-streaming-diloco-avg",
               "allreduce-4bit", "streaming-local-sgd-4bit", "streaming-local-sgd-4bit-moments", "diloco-sparseloco",
               "streaming-diloco-sparseloco")
SLOW_BITS = 50e6
LRS_PATH = os.path.join(os.path.dirname(__file__), "lrs.json")


def setups_for(link: str, setups: list[str], fast: tuple[str, ...] | None = FAST_SETUPS) -> list[str]:
    """The setups that run on ``link``: the fast subset on fast links, the slow subset on the slowest (< 50 Mbit/s),
    all of ``setups`` in between and on loopback (``fast=None``: all everywhere)."""
    from .advisor import rate_bits

    bits = rate_bits(link)
    if fast is not None and bits < SLOW_BITS:
        return [s for s in setups if s in SLOW_SETUPS]
    if fast is None or not bits >= FAST_BITS:
        return list(setups)
    return [s for s in setups if s in fast]


def stored_choice(path: str = LRS_PATH) -> dict[tuple[str, str], dict[str, Any]]:
    """The committed sweep's choice per (task, setup), as :func:`choose_lrs` gives it; empty when absent."""
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        data = json.load(f)
    return {(t, s): {"lr": float(v["lr"]), "final": v["final"], "tried": {float(k): q for k, q in v["tried"].items()}}
            for t, per in data["lrs"].items() for s, v in per.items()}


def inherit_lrs(lrs: dict[tuple[str, str], float]) -> dict[tuple[str, str], float]:
    """The swept lrs plus those inherited: a variant (``QSetup.lr_of``) runs at the lr of the setup it varies
    (itself swept or inherited: a variant of a variant), an unswept torchft peer at phalanx DiLoCo's (the same
    inner AdamW).

        >>> out = inherit_lrs({("gpt", "streaming-diloco-4bit"): 2e-3, ("gpt", "diloco"): 1e-3, ("gpt", "ddp"): 1e-3})
        >>> out[("gpt", "streaming-diloco-4bit-avg")], out[("gpt", "torchft-streaming-diloco-avg")]
        (0.002, 0.001)
        >>> out[("gpt", "streaming-local-sgd-4bit-eager")]   # via streaming-local-sgd-4bit, DDP's
        0.001
    """
    out = dict(lrs)
    grew = True
    while grew:  # until no variant's parent gains an lr: chains are short, and SETUPS holds no cycle
        new = {(task, v.name): lr for (task, setup), lr in out.items() for v in SETUPS.values()
               if v.lr_of == setup and (task, v.name) not in out}
        out.update(new)
        grew = bool(new)
    for (task, setup), lr in lrs.items():
        if setup == "diloco":
            out.update({(task, peer): lr for peer in TORCHFT if (task, peer) not in out})
    return out


@dataclass(frozen=True)
class QRun:
    """One run: a task trained by a setup on 2 workers over a link, with its lr and limits."""

    task: str
    setup: str
    link: str
    lr: float
    budget_s: float
    max_steps: int = 0
    per_worker: int = 16
    workers: int = 2
    threads: int = 1

    @property
    def provider(self) -> str:
        return SETUPS[self.setup].provider

    @property
    def title(self) -> str:
        return f"{self.task} {self.setup} {self.workers}x{self.threads} {self.link} lr={self.lr:g}"

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "provider": self.provider}


def family(task: str, setup: str) -> str:
    return SETUPS[setup].optim or get(task).optim.name


def base_lr(task: str, setup: str) -> float:
    return get(task).base_lr(family(task, setup))


def sweep_runs(tasks: list[str], setups: list[str], multipliers: tuple[float, ...], *, steps: int,
               cap_s: float) -> list[QRun]:
    """Every setup × multiplier on loopback for ``steps`` steps (at most ``cap_s`` s): the lr sweep."""
    return [QRun(t, s, "loopback", base_lr(t, s) * m, cap_s, steps, get(t).per_worker)
            for t in tasks for s in setups for m in multipliers]


def main_runs(tasks: list[str], setups: list[str], links: list[str], *, lrs: dict[tuple[str, str], float],
              budgets: dict[str, float], fast: tuple[str, ...] | None = None) -> list[QRun]:
    """Every task × link × setup (the fast subset on fast links when ``fast`` is given), at its chosen lr."""
    return [QRun(t, s, link, lrs.get((t, s), base_lr(t, s)), budgets[t], 0, get(t).per_worker)
            for t in tasks for link in links for s in setups_for(link, setups, fast)]


def config(run: QRun, seed: int = 0, evals: int = 12) -> dict[str, Any]:
    """What the worker reads (:mod:`.worker`)."""
    return {"task": run.task, "setup": run.setup, "lr": run.lr, "budget_s": run.budget_s,
            "max_steps": run.max_steps, "per_worker": run.per_worker, "threads": run.threads, "seed": seed,
            "evals": evals, "check_every": 4}


def estimate_s(runs: list[QRun], repeats: int = 1, steps_s: float = 0.15) -> float:
    """Estimate of the wall time: each run's budget (or its steps at ``steps_s`` each) plus the per-run
    overhead, times repeats, plus one session start per link."""
    per_run = sum((r.budget_s if not r.max_steps else min(r.budget_s, r.max_steps * steps_s)) + OVERHEAD_S
                  for r in runs)
    return repeats * per_run + SESSION_S * len({r.link for r in runs})


def choose_lrs(records: list[dict[str, Any]], higher: dict[str, bool],
               band: dict[str, float] | None = None) -> dict[tuple[str, str], dict[str, Any]]:
    """Per (task, setup): the swept lr with the best final quality (a failed or nan run never wins).

    With ``band`` (task -> quality difference), the base lr (multiplier 1) is kept unless another lr beats
    it by more than that: a difference inside the sweep's noise is not a reason to tune one setup differently.
    """
    best: dict[tuple[str, str], dict[str, Any]] = {}
    for rec in records:
        r = rec["run"]
        final = rec["ranks"][0]["final"] if not rec["error"] and rec["ranks"] else float("nan")
        key = (r["task"], r["setup"])
        entry = best.setdefault(key, {"lr": r["lr"], "final": float("nan"), "tried": {}})
        entry["tried"][r["lr"]] = final
        if final != final:
            continue
        old = entry["final"]
        if old != old or (final > old if higher[r["task"]] else final < old):
            entry.update(lr=r["lr"], final=final)
    for (task, setup), entry in best.items():
        base = base_lr(task, setup)
        at_base = next((q for lr, q in entry["tried"].items() if abs(lr - base) <= 1e-9 * base), float("nan"))
        if band and task in band and at_base == at_base and abs(entry["final"] - at_base) <= band[task]:
            entry.update(lr=base, final=at_base)
    return best
