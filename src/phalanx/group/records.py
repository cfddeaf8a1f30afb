"""Per-group records: what another package keeps for each group, typed and owned by that package.

The :class:`~phalanx.group.group.Group` holds membership only. A package that needs something per
group (the step clocks, the preemption handler, the checkpoint being written, the timeline spans go
to) declares one :class:`Record` at module level, a constant naming its type, and reads it with
``RECORD.of(g)``: the group keeps the value without knowing what it is, so a new feature adds a
record of its own, never a slot to ``Group``. A record that has work to finish before its group is
left (a checkpoint still being written, a trace to write) implements :class:`Leaves`.

Example:
    >>> class Counter:
    ...     def __init__(self) -> None: self.n = 0
    >>> COUNTS: Record[Counter] = Record("counts", Counter)
    >>> rs = Records(); COUNTS.in_(rs).n += 1; COUNTS.in_(rs).n
    1
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Generic, Protocol, TypeVar, cast, runtime_checkable

if TYPE_CHECKING:
    from .group import Group

T = TypeVar("T")


@runtime_checkable
class Leaves(Protocol):
    """A record with work to finish before its group is left (``px.shutdown()``, at exit)."""

    def before_leaving(self, failing: bool) -> None:
        """Finish what is in flight; ``failing``: this worker leaves on an error (peers may be gone)."""


class Record(Generic[T]):
    """The key of one package's per-group value of type ``T``, made by ``make()`` on first use."""

    def __init__(self, name: str, make: Callable[[], T]) -> None:
        self.name, self.make = name, make

    def of(self, g: Group) -> T:
        """This record's value in group ``g`` (made now if it has none)."""
        return self.in_(g.records)

    def in_(self, records: Records) -> T:
        """This record's value in ``records`` (made now if it has none)."""
        return records.get(self)

    def __repr__(self) -> str:
        return f"Record({self.name!r})"


class Slot(Generic[T]):
    """A record that holds one value or none (``None`` until its package sets it)."""

    def __init__(self) -> None:
        self.value: T | None = None


class Records:
    """The values one group keeps for the packages that use it, in the order they were made."""

    def __init__(self) -> None:
        self._values: dict[Record[object], object] = {}

    def get(self, record: Record[T]) -> T:
        key = cast("Record[object]", record)
        if key not in self._values:
            self._values[key] = record.make()
        return cast(T, self._values[key])

    def before_leaving(self, failing: bool) -> None:
        """Let every record that :class:`Leaves` finish its work, in the order they were made."""
        for value in list(self._values.values()):
            if isinstance(value, Leaves):
                value.before_leaving(failing)


__all__ = ["Leaves", "Record", "Records", "Slot"]
