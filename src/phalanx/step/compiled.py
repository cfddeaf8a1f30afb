"""``torch.compile`` and phalanx: the one place that looks inside a compiled module.

``torch.compile(model)`` returns an ``OptimizedModule`` that holds the user's module;
torch offers no public way to tell one apart or to reach the module inside, so this
module does it, once, for :func:`phalanx.unwrap`, ``px.wrap`` and the tests. Both orders
work (docs/porting.md, "torch.compile"): ``px.wrap(torch.compile(model), opt)`` and
``torch.compile(model)`` on the module ``px.wrap`` returned.

Example:
    >>> import torch
    >>> from phalanx.step.compiled import is_compiled, original
    >>> net = torch.nn.Linear(2, 1)
    >>> is_compiled(net), original(net) is net
    (False, True)
"""
from __future__ import annotations

import sys

from torch import nn


def _optimized_module() -> type | None:
    """torch's compiled-module class, or None while ``torch._dynamo`` is not imported.

    Only ``torch.compile`` makes an ``OptimizedModule``, and it imports dynamo first; importing dynamo here
    would cost every worker 2 s of start-up (``python -X importtime``), compiled or not.
    """
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    return getattr(eval_frame, "OptimizedModule", None)


def is_compiled(module: object) -> bool:
    """True for what ``torch.compile(module)`` returned (an ``OptimizedModule``)."""
    cls = _optimized_module()
    return cls is not None and isinstance(module, cls)


def original(module: nn.Module) -> nn.Module:
    """The module inside ``torch.compile``'s wrapper(s); ``module`` itself when it is not compiled."""
    while is_compiled(module):
        module = module._orig_mod  # type: ignore[assignment]
    return module


def compilations() -> int:
    """Graphs ``torch.compile`` has built in this process so far (each recompilation and graph break adds one).

    For tests and benchmarks: a steady loop adds none after its first step per input shape.
    """
    from torch._dynamo.utils import counters  # dynamo's own counters: the count torch's tests use too
    return int(counters["stats"]["unique_graphs"])


def graph_breaks() -> int:
    """Graph breaks ``torch.compile`` has met in this process so far (for tests and benchmarks)."""
    from torch._dynamo.utils import counters
    return int(sum(counters["graph_break"].values()))


__all__ = ["compilations", "graph_breaks", "is_compiled", "original"]
