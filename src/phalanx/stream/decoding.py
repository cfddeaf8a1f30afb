"""Events to training batches: decode, dead-letter what cannot be decoded, collate.

A decoder may carry a batched form (``decode.batch``, as :func:`phalanx.stream.decode_samples`
does): a whole part is then checked in one call and collated from the events' fields, and
events are decoded one by one only when that call fails, to find the bad ones.

Example:
    >>> from phalanx.stream.source import Event
    >>> class Src:
    ...     decode = staticmethod(lambda fields: int(fields["x"]))
    >>> kept = payloads(Src, [Event("1-0", {"x": "3"}), Event("2-0", {"x": "?"})])
    >>> kept[0], kept[1] is DEAD
    (3, True)
"""
from __future__ import annotations

from typing import Any

from torch.utils.data import default_collate

from .source import Event, StreamError, StreamSource

DEAD = object()  # a claimed entry that was dead-lettered: it moves the position but is not trained


def decode_one(source: StreamSource, event: Event) -> tuple[Any, str | None]:
    """``(sample, None)``, or ``(None, reason)`` when the event cannot be decoded."""
    try:
        return source.decode(event.fields), None
    except Exception as err:  # a bad event must not stop training: it is dead-lettered with the reason
        return None, f"{type(err).__name__}: {err}"


def payloads(source: StreamSource, events: list[Event]) -> list[Any]:
    """What to keep of each event: ``DEAD`` if it cannot be decoded; else its fields when the decoder
    decodes whole parts at once (checked here for the lot in one call), or its decoded sample."""
    batch = getattr(source.decode, "batch", None)
    if batch is not None:
        try:
            batch([e.fields for e in events])
            return [e.fields for e in events]
        except Exception:  # noqa: BLE001 - some event is bad: find which, one by one
            pass
    decoded = [decode_one(source, e) for e in events]
    if batch is not None:
        return [e.fields if reason is None else DEAD for e, (_, reason) in zip(events, decoded)]
    return [sample if reason is None else DEAD for sample, reason in decoded]


def collate(source: StreamSource, items: list[Any]) -> Any:
    """One batch from kept payloads, with the decoder's batched form when it has one."""
    batch = getattr(source.decode, "batch", None)
    return batch(items) if batch is not None else default_collate(items)


def decode_part(source: StreamSource, events: list[Event], count: int) -> tuple[list[str], Any]:
    """A worker's part of a step: its good events' ids and their batch. ``count`` is how many good events the
    main worker found there (0: a stand-in of weight 0, see :func:`phalanx.stream.plan.split`); raises
    ValueError when this worker finds another number."""
    batch = getattr(source.decode, "batch", None)
    if batch is not None and 0 < count == len(events):  # the usual case: decode the part once, in one call
        try:
            return [e.id for e in events], batch([e.fields for e in events])
        except Exception:  # noqa: BLE001 - some event is bad: the checks below find it and say so
            pass
    good = [(e.id, p) for e, p in zip(events, payloads(source, events)) if p is not DEAD]
    if count == 0:
        return [], collate(source, [p for _, p in good[:1]])
    if len(good) != count:
        raise ValueError(f"found {len(good)} good events but the main worker claimed {count}")
    return [i for i, _ in good], collate(source, [p for _, p in good])


def fetch_parts(source: StreamSource, rank: int, parts: list[tuple[str, str, int]]) -> list[tuple[list[str], Any]]:
    """Worker ``rank``'s parts of several planned steps, fetched and decoded: one task (one thread wake-up), one
    read per part (each read hands the GIL back to the training thread; one pipelined read of all parts held it
    longer)."""
    out = []
    for first, last, count in parts:
        try:
            out.append(decode_part(source, source.fetch(first, last), count))
        except ValueError as err:
            raise StreamError(f"worker {rank} {err} in {first}..{last} of stream {source.stream!r}; expected the "
                              "same entries and the same decoding everywhere. Do not delete entries that are not "
                              "yet acknowledged, and make decode deterministic.") from None
    return out
