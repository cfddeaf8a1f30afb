"""What to run: setup names, their arguments, and the sweep's list of runs.

A *setup* is how one configuration trains:

* ``plain``: a plain PyTorch loop, no phalanx, in one process (with T threads);
* ``ddp``, ``ddp-fp16``, ``ddp-powersgd``: raw ``torch.nn.parallel.DistributedDataParallel``,
  the peer, with no hook, its fp16 hook or its PowerSGD hook;
* any phalanx strategy name from :data:`phalanx.strategies.REGISTRY` (``allreduce``,
  ``local-sgd``, ``powersgd``...), built through its registered factory.

Arguments go in brackets: ``allreduce[bucket_mb=2]``, ``ddp-powersgd[rank=1]``,
``local-sgd[every=4]``; values are Python literals. ``shard=S`` on a phalanx strategy shards
the model over groups of S workers (``allreduce[shard=2]`` is FSDP/HSDP, ``diloco[shard=2]``
DiLoCo across groups; :mod:`phalanx.sharding.layout`).

Example:
    >>> parse_setup("ddp-powersgd[rank=2]")
    Setup(name='ddp-powersgd', kwargs={'rank': 2})
    >>> split_list("allreduce,local-sgd[every=4,warmup_steps=0],ddp")
    ['allreduce', 'local-sgd[every=4,warmup_steps=0]', 'ddp']
"""
from __future__ import annotations

import ast
import re
from dataclasses import asdict, dataclass, field
from typing import Any

from ..errors import ConfigError, usage
from ..strategies import REGISTRY

PEERS = ("ddp", "ddp-fp16", "ddp-powersgd")  # torch DDP: no hook, its fp16 hook, its PowerSGD hook
PEER_KWARGS = {"bucket_mb", "static_graph", "broadcast_buffers", "gradient_as_bucket_view", "rank", "start_iter"}


@dataclass(frozen=True)
class Setup:
    name: str
    kwargs: dict[str, Any] = field(default_factory=dict)

    @property
    def kind(self) -> str:
        return "plain" if self.name == "plain" else "ddp" if self.name in PEERS else "phalanx"

    @property
    def label(self) -> str:
        args = ",".join(f"{k}={v!r}" for k, v in self.kwargs.items())
        return f"{self.name}[{args}]" if args else self.name

    def __hash__(self) -> int:
        return hash(self.label)


def split_list(text: str) -> list[str]:
    """Split on commas that are not inside brackets."""
    items, depth, cur = [], 0, ""
    for ch in text:
        depth += {"[": 1, "]": -1}.get(ch, 0)
        if ch == "," and depth == 0:
            items.append(cur)
            cur = ""
        else:
            cur += ch
    items.append(cur)
    return [i.strip() for i in items if i.strip()]


def parse_setup(text: str) -> Setup:
    m = re.fullmatch(r"\s*([A-Za-z0-9_.\-]+)\s*(?:\[(.*)\])?\s*", text)
    if not m:
        raise ConfigError(usage(f"setup {text!r}", "NAME or NAME[key=value,...]", "E.g. allreduce[bucket_mb=2]."))
    name = m.group(1).lower().replace("_", "-")
    kwargs: dict[str, Any] = {}
    for part in split_list(m.group(2) or ""):
        key, eq, raw = part.partition("=")
        if not eq or not key.strip().isidentifier():
            raise ConfigError(usage(f"argument {part!r} in {text!r}", "key=value", "E.g. local-sgd[every=4]."))
        try:
            kwargs[key.strip()] = ast.literal_eval(raw.strip())
        except (ValueError, SyntaxError):
            kwargs[key.strip()] = raw.strip()  # a bare word: keep it as a string
    return Setup(name, kwargs)


def check_setup(setup: Setup) -> None:
    """Refuse, before anything runs, a name nobody registered or arguments a peer does not take."""
    if setup.kind == "ddp":
        bad = sorted(set(setup.kwargs) - PEER_KWARGS)
        if bad:
            raise ConfigError(usage(f"{setup.label}: unknown argument(s) {', '.join(bad)}",
                                    "some of " + ", ".join(sorted(PEER_KWARGS)), "Drop or rename them."))
        return
    if setup.kind == "phalanx" and setup.name not in REGISTRY:
        known = sorted(set(REGISTRY) | set(PEERS) | {"plain"})
        raise ConfigError(usage(f"unknown strategy {setup.name!r}", "one of " + ", ".join(known),
                                "It may not be registered in this version of phalanx yet "
                                "(phalanx.strategies.register); leave it out of --strategies."))


def build_strategy(setup: Setup) -> Any:
    """The phalanx strategy object for ``setup`` (its registered factory, with the bracket arguments)."""
    check_setup(setup)
    kwargs = {k: v for k, v in setup.kwargs.items() if k != "shard"}  # the worker passes it to px.wrap
    try:
        return REGISTRY[setup.name](**kwargs)
    except TypeError as err:
        raise ConfigError(usage(f"{setup.label}: {err}", "arguments its factory accepts",
                                f"See help(phalanx.strategies.REGISTRY[{setup.name!r}]).")) from None


@dataclass(frozen=True)
class Run:
    """One configuration of the sweep: a model trained by a setup on N processes x T threads over a link."""

    model: str
    setup: Setup
    workers: int = 1
    threads: int = 1
    link: str = "loopback"
    batch: int = 64

    @property
    def title(self) -> str:
        return f"{self.model} {self.setup.label} {self.workers}x{self.threads} {self.link}"

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["setup"] = {"name": self.setup.name, "kwargs": self.setup.kwargs, "label": self.setup.label}
        return d


def plan(models: list[str], setups: list[Setup], workers: list[int], threads: list[int], links: list[str],
         batch: int = 64, plain: bool = True) -> list[Run]:
    """Every run of a sweep, baselines first.

    Per model: the plain loop in 1 process x 1 thread (the baseline) and x T threads
    for each T in ``threads``; then each setup on each worker count. One worker has
    no link, so it runs once, on loopback; more workers run once per link.
    """
    runs: list[Run] = []
    for model in models:
        if plain:
            for t in sorted({1, *threads}):
                runs.append(Run(model, Setup("plain"), 1, t, "loopback", batch))
        for setup in setups:
            for n in workers:
                for link in (["loopback"] if n == 1 else links):
                    runs.append(Run(model, setup, n, 1, link, batch))
    return list(dict.fromkeys(runs))
