"""Optimizer state averaged with each fragment of Streaming DiLoCo: the inner optimizer's moments.

Streaming DiLoCo (arXiv 2501.18512) averages only the weights; each worker's inner optimizer
keeps its own state. With few inner steps between a fragment's exchanges, each replica's
momentum is an average over its own half of the batch, and that noise costs steps. DES-LOC
(Iacob et al. 2025, "Desynced Low Communication Adaptive Optimizers", arXiv 2505.22549)
averages the optimizer's states too. Here the named per-parameter states (``exp_avg``,
``exp_avg_sq``, ``momentum_buffer``) travel in the same message as the fragment's
pseudo-gradient, and when the average lands ``k`` optimizer steps after the send, each
worker swaps its own part for the average's:

    state += decay**k * (average_sent - own_sent)

exact for these states, which are linear recurrences ``s = decay * s + (…)`` in their old
value (``decay``: AdamW's β1 for ``exp_avg``, β2 for ``exp_avg_sq``, SGD's momentum for
``momentum_buffer``). ``exp_avg_sq`` is clamped at 0 afterwards, since a quantised average may
dip below.

Example:
    >>> import torch
    >>> net = torch.nn.Linear(2, 1)
    >>> opt = torch.optim.AdamW(net.parameters(), lr=0.1, betas=(0.5, 0.9))
    >>> m = Moments(("exp_avg",)).bind(opt)
    >>> net(torch.ones(1, 2)).sum().backward(); opt.step()
    >>> sent = m.take(list(net.parameters()))          # what this worker sends
    >>> average = [s + 1.0 for s in sent]                # what the workers' mean came back as
    >>> net(torch.ones(1, 2)).sum().backward(); opt.step()   # one more step while it travelled
    >>> before = opt.state[net.bias]["exp_avg"].clone()
    >>> m.correct(list(net.parameters()), sent, average, steps=1)
    >>> (opt.state[net.bias]["exp_avg"] - before).item()   # 0.5**1 x (average - sent)
    0.5
"""
from __future__ import annotations

from typing import Sequence

import torch

from ..errors import ConfigError, usage
from .diloco import _outer_dtype

# Which hyperparameter of a parameter group is each state's decay: (group key, index into it or None).
DECAYS: dict[str, tuple[str, int | None]] = {"exp_avg": ("betas", 0), "exp_avg_sq": ("betas", 1),
                                             "momentum_buffer": ("momentum", None)}


class Moments:
    """The named optimizer states averaged with each fragment (see the module docstring).

    Args:
        keys: names in ``optimizer.state[p]``: ``"exp_avg"`` (Adam's first moment), ``"exp_avg_sq"``
            (its second), ``"momentum_buffer"`` (SGD's momentum); or ``"momentum"``: whichever of
            ``exp_avg`` and ``momentum_buffer`` the optimizer keeps.
    """

    def __init__(self, keys: Sequence[str] = ()) -> None:
        if isinstance(keys, str):
            keys = (keys,)
        keys = tuple(keys)
        bad = [k for k in keys if k not in DECAYS and k != "momentum"]
        if bad or len(set(keys)) != len(keys):
            raise ConfigError(usage(f"StreamingDiLoCo(moments={keys!r})",
                                    f"distinct names among momentum, {', '.join(DECAYS)}",
                                    "Pass moments=('exp_avg',) for Adam/AdamW or ('momentum_buffer',) for SGD "
                                    "with momentum."))
        self.keys = keys
        self._decay: dict[int, list[float]] = {}  # id(parameter) -> each key's decay, from its parameter group
        self._optimizer: torch.optim.Optimizer | None = None  # set by bind(), at the strategy's attach

    def __bool__(self) -> bool:
        return bool(self.keys)

    def bind(self, optimizer: torch.optim.Optimizer) -> "Moments":
        """Read each parameter's decays from its parameter group; refuse an optimizer that has none.

        ``"momentum"`` becomes the optimizer's own: ``exp_avg`` where its groups have ``betas`` (Adam,
        AdamW), else ``momentum_buffer`` (SGD)."""
        first = "exp_avg" if "betas" in optimizer.param_groups[0] else "momentum_buffer"
        self.keys = tuple(first if k == "momentum" else k for k in self.keys)
        self._decay = {}
        for group in optimizer.param_groups:
            decays = []
            for k in self.keys:
                name, index = DECAYS[k]
                value = group.get(name)
                if value is None or (index is not None and not isinstance(value, (tuple, list))) or \
                        (index is None and not value):
                    raise ConfigError(usage(
                        f"StreamingDiLoCo(moments={self.keys!r}) with {type(optimizer).__name__}, whose parameter "
                        f"group has {name}={value!r}", f"an optimizer that keeps {k!r} (its decay from {name!r})",
                        "Pass moments=('exp_avg',) with Adam/AdamW, ('momentum_buffer',) with SGD(momentum>0), "
                        "or leave moments unset."))
                decays.append(float(value[index] if index is not None else value))
            for p in group["params"]:
                self._decay[id(p)] = decays
        self._optimizer = optimizer
        return self

    def numel(self, params: Sequence[torch.Tensor]) -> int:
        """Values one fragment's states add to its message."""
        return len(self.keys) * sum(p.numel() for p in params)

    @torch.no_grad()
    def take(self, params: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Copies of the states, key-major, in the anchors' dtype; zeros where a parameter has none yet."""
        out = []
        for k in self.keys:
            for p in params:
                s = self._optimizer.state.get(p, {}).get(k)
                dtype = _outer_dtype(p)  # the pseudo-gradient's dtype: both travel in one message
                out.append(torch.zeros_like(p, dtype=dtype) if s is None else s.detach().to(dtype, copy=True))
        return out

    @torch.no_grad()
    def correct(self, params: Sequence[torch.Tensor], sent: Sequence[torch.Tensor],
                average: Sequence[torch.Tensor], steps: int) -> None:
        """``steps`` optimizer steps after the send: replace this worker's sent part by the average's."""
        for j, k in enumerate(self.keys):
            for i, p in enumerate(params):
                s = self._optimizer.state.get(p, {}).get(k)
                if s is None:  # never stepped here (no gradient yet): nothing of its own to replace
                    continue
                n = j * len(params) + i
                s.add_(((average[n] - sent[n]) * self._decay[id(p)][j] ** steps).to(s.dtype))
                if k == "exp_avg_sq":
                    s.clamp_(min=0)

    def __repr__(self) -> str:
        return repr(self.keys)


__all__ = ["DECAYS", "Moments"]
