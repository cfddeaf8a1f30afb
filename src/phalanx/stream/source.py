"""The small protocol a stream source implements, and stream positions.

A source is a durable, ordered log of events read through a consumer group. The
loader needs only five operations from it, so a Kafka source can be added
without touching the loop: for Kafka the position would be one offset per
partition instead of one entry id.

Positions are Redis entry ids, ``"<milliseconds>-<sequence>"``: they order the
log, survive restarts, and are plain strings, so they ride in a checkpoint.

Example:
    >>> from phalanx.stream.source import parse_id, format_id, before
    >>> parse_id("1700000000000-3")
    (1700000000000, 3)
    >>> format_id(*parse_id("5-0")), before("5-0"), before("5-2")
    ('5-0', '4-18446744073709551615', '5-1')
"""
from __future__ import annotations

from typing import Any, Callable, NamedTuple, Protocol, runtime_checkable

from ..errors import PhalanxError

START = "0-0"  # before every entry: a fresh group reads the stream from its beginning
MAX_SEQ = 2**64 - 1


END_FIELD = b"phalanx-end"  # an event carrying this field ends the run (see producer.end_of_stream)


class StreamError(PhalanxError, RuntimeError):
    """The broker went away, or the stream lost entries that were never trained."""


class Event(NamedTuple):
    """One entry of the log: its id and its raw fields (bytes to bytes).

    A named tuple, not a dataclass: the loader makes thousands a second, and a tuple is the cheapest."""
    id: str
    fields: dict[bytes, bytes]


def parse_id(entry_id: str | bytes) -> tuple[int, int]:
    """``"ms-seq"`` as a pair of ints (ordering ids numerically, never as strings)."""
    text = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
    ms, _, seq = text.partition("-")
    return int(ms), int(seq or 0)


def format_id(ms: int, seq: int) -> str:
    return f"{ms}-{seq}"


def before(entry_id: str) -> str:
    """The largest id smaller than ``entry_id`` (where a group must stand to read it next)."""
    ms, seq = parse_id(entry_id)
    return format_id(ms, seq - 1) if seq > 0 else format_id(ms - 1, MAX_SEQ)


@runtime_checkable
class StreamSource(Protocol):
    """What :class:`phalanx.stream.StreamLoader` needs from a broker.

    Only the main worker claims, acknowledges and rewinds (one consumer for the
    whole group keeps the global order); every worker fetches its own slice.
    """

    url: str
    stream: str
    decode: Callable[[dict[bytes, bytes]], Any]  # fields -> one sample (a tuple of tensors)

    def rewind(self, position: str | None, offset: int | None = None) -> tuple[str, int | None]:
        """Make the next :meth:`claim` start right after ``position`` (``None``: the last
        acknowledged position). Returns the position and how many entries precede it (if known)."""

    def claim(self, count: int, block_s: float) -> list[Event]:
        """Up to ``count`` entries after the last claimed one, waiting at most ``block_s``."""

    def fetch(self, first: str, last: str) -> list[Event]:
        """The entries with ids in ``[first, last]``, in order."""

    def acknowledge(self, position: str) -> None:
        """Tell the broker every claimed entry up to ``position`` is trained and committed."""

    def check(self, position: str, offset: int | None = None) -> int:
        """Raise if entries after ``position`` (the ``offset``-th entry) were deleted; return how many
        entries were ever added."""

    def dead_letter(self, event: Event, reason: str) -> None:
        """Set aside an event that could not be decoded, with its id and the reason."""
