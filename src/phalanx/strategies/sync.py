"""Sync conditions: when replicas talk.

Example:
    >>> import phalanx as px
    >>> [s for s in range(1, 10) if px.every(4)(s)]
    [4, 8]
"""
from __future__ import annotations

from dataclasses import dataclass

from .. import check
from ..errors import ConfigError, usage


@dataclass(frozen=True)
class every:  # noqa: N801 - reads as a rule: px.every(8)
    """Sync on every ``k``-th local step."""

    k: int

    def __post_init__(self) -> None:
        check.positive_int("every", self.k, "Pass the number of local steps between syncs, e.g. every(8).")

    def __call__(self, step: int) -> bool:
        return step % self.k == 0

    def __repr__(self) -> str:
        return f"every({self.k})"


@dataclass(frozen=True)
class schedule:  # noqa: N801 - reads as a rule: px.schedule(sync_steps=500, then=px.every(8))
    """Synchronous for the first ``sync_steps`` steps, then ``then`` (counted from the switch).

    "Synchronous for the first E epochs" is ``sync_steps=E * len(loader)``. Strategies
    that can average gradients (``px.LocalSGD``) do so while :meth:`synchronous` is
    true, which is post-local SGD (Lin et al. 2020); any other ``Periodic`` strategy
    simply exchanges on every one of those steps.

    Example:
        >>> import phalanx as px
        >>> rule = px.schedule(sync_steps=3, then=px.every(4))
        >>> [s for s in range(1, 12) if rule(s)], rule.synchronous(3), rule.synchronous(4)
        ([1, 2, 3, 7, 11], True, False)
    """

    sync_steps: int
    then: "every | schedule"

    def __post_init__(self) -> None:
        check.integer("sync_steps", self.sync_steps, "Pass a whole number of optimizer steps for sync_steps.")
        if isinstance(self.then, int) and not isinstance(self.then, bool):
            object.__setattr__(self, "then", every(self.then))
        if not callable(self.then):
            raise ConfigError(usage(f"then={self.then!r}", "a sync condition such as px.every(8)",
                                    "Pass the rule to follow after the synchronous steps."))

    def synchronous(self, step: int) -> bool:
        """True while step (1-based) is still in the synchronous phase."""
        return step <= self.sync_steps

    def __call__(self, step: int) -> bool:
        return self.synchronous(step) or bool(self.then(step - self.sync_steps))

    def __repr__(self) -> str:
        return f"schedule(sync_steps={self.sync_steps}, then={self.then!r})"


def is_synchronous(condition: object, step: int) -> bool:
    """Whether ``condition`` asks for step-by-step synchronous training at ``step``."""
    probe = getattr(condition, "synchronous", None)
    return bool(probe(step)) if callable(probe) else False


def as_condition(value: object, name: str = "every") -> object:
    """An int becomes ``every(int)``; a sync condition passes through; anything else is refused."""
    if isinstance(value, int) and not isinstance(value, bool):
        return every(value)
    if callable(value) and not isinstance(value, type):
        return value
    raise ConfigError(usage(f"{name}={value!r}", "an integer >= 1 or a sync condition such as px.schedule(...)",
                            "Pass e.g. every=8."))
