"""Sync conditions: when replicas talk.

Example:
    >>> import phalanx as px
    >>> [s for s in range(1, 10) if px.every(4)(s)]
    [4, 8]
"""
from __future__ import annotations

from dataclasses import dataclass

from .errors import ConfigError, usage


@dataclass(frozen=True)
class every:  # noqa: N801 - reads as a rule: px.every(8)
    """Sync on every ``k``-th local step."""

    k: int

    def __post_init__(self) -> None:
        if not isinstance(self.k, int) or isinstance(self.k, bool) or self.k < 1:
            raise ConfigError(usage(f"every={self.k!r}", "an integer >= 1",
                                    "Pass the number of local steps between syncs, e.g. every(8)."))

    def __call__(self, step: int) -> bool:
        return step % self.k == 0

    def __repr__(self) -> str:
        return f"every({self.k})"
