"""Events to training batches: decode, dead-letter what does not fit, collate.

A bad event is one the user's ``decode`` raises on, or one that decodes but does not fit the
batch: another shape, dtype or structure. Every batch must have the *structure* the first
events fixed (each tensor's dtype and shape, each container's layout); the main worker fixes it
from the most common structure of its first read, carries its fingerprint in every plan and in
the loader's state, so every worker, and every restart, drops the same events. One well-formed
event of another shape would otherwise fail the whole step's stacking on every try.

A decoder may carry a batched form (``decode.batch``, as :func:`phalanx.stream.decode_samples`
does): a whole part is then checked in one call and collated from the events' fields, and
events are decoded one by one only when that call fails or gives another structure, to find
the bad ones.

Example:
    >>> from phalanx.stream.source import Event
    >>> d = Decoder(lambda fields: (torch.tensor(eval(fields[b"x"])), int(fields[b"y"])))
    >>> kept, reasons = d.check([Event("1-0", {b"x": b"[1.0, 2.0]", b"y": b"3"}),
    ...                          Event("2-0", {b"x": b"[1.0]", b"y": b"0"}), Event("3-0", {b"x": b"[1.0, 0.0]"})])
    >>> [k is DEAD for k in kept], reasons[1][:53], reasons[2]
    ([False, True, True], 'another shape or dtype: (float32[1], int) where the b', "KeyError: b'y'")
"""
from __future__ import annotations

import collections
import hashlib
from typing import Any, Callable, Mapping

import numpy as np
import torch
from torch.utils.data import default_collate

from .source import Event, StreamError, StreamSource

DEAD = object()  # a claimed entry that was dead-lettered: it moves the position but is not trained


def structure(sample: Any, batched: bool = False) -> str:
    """What every sample of a batch must share, as text: each tensor's dtype and shape (without the
    leading batch dimension when ``batched``), each container's layout, each other value's type.

    Example:
        >>> structure((torch.zeros(2, 3), 1))
        '(float32[2,3], int)'
        >>> structure((torch.zeros(5, 2, 3), torch.zeros(5, dtype=torch.int64)), batched=True)
        '(float32[2,3], int64[])'
    """
    if isinstance(sample, (torch.Tensor, np.ndarray)):
        dims = tuple(sample.shape)[1 if batched else 0:]
        return f"{str(sample.dtype).removeprefix('torch.')}[{','.join(map(str, dims))}]"
    if isinstance(sample, Mapping):
        return "{" + ", ".join(f"{k!r}: {structure(v, batched)}" for k, v in sample.items()) + "}"
    if isinstance(sample, (tuple, list)):
        if batched and all(isinstance(v, (str, bytes, int, float, bool)) for v in sample):
            return "[" + "|".join(sorted({type(v).__name__ for v in sample})) + " per sample]"  # one per sample
        inner = ", ".join(structure(v, batched) for v in sample)
        return f"({inner})" if isinstance(sample, tuple) else f"[{inner}]"
    return type(sample).__name__


def fingerprint(text: str) -> int:
    """A structure as one non-zero int64 (0 means "not fixed yet"), the same in every process."""
    value = int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little", signed=True)
    return value or 1


def _why(err: Exception) -> str:
    return f"{type(err).__name__}: {err}"


class Decoder:
    """The user's ``decode`` (and its batched form) with the structure every batch must have.

    ``expected`` is a :func:`fingerprint`, 0 while not fixed: :meth:`check` then fixes it from the events."""

    def __init__(self, decode: Callable[[dict[bytes, bytes]], Any], expected: int = 0) -> None:
        self.decode, self.batch = decode, getattr(decode, "batch", None)
        self.expected = expected
        self._texts: dict[int, str] = {}  # fingerprints this process has seen, for readable reasons

    def _texts_seen(self, text: str) -> int:
        value = fingerprint(text)
        self._texts.setdefault(value, text)
        return value

    def batch_fits(self, batch: Any) -> bool:
        """Whether a part decoded at once has the expected structure (fixing it when it is not fixed yet)."""
        value = self._texts_seen(structure(batch, batched=True))
        if not self.expected:
            self.expected = value
        return value == self.expected

    def check(self, events: list[Event]) -> tuple[list[Any], list[str | None]]:
        """What to keep of each event, and why not: ``DEAD`` with a reason for a bad event; else its fields
        when the decoder decodes whole parts at once (checked here for the lot in one call), or its sample."""
        if self.batch is not None:
            try:
                if self.batch_fits(self.batch([e.fields for e in events])):
                    return [e.fields for e in events], [None] * len(events)
            except Exception:  # noqa: BLE001 - some event is bad: find which, one by one
                pass
        items: list[tuple[Any, int, str | None]] = []
        for e in events:
            try:
                if self.batch is not None:
                    items.append((e.fields, self._texts_seen(structure(self.batch([e.fields]), batched=True)), None))
                else:
                    sample = self.decode(e.fields)
                    items.append((sample, self._texts_seen(structure(sample)), None))
            except Exception as err:  # a bad event must not stop training: it is dead-lettered with the reason
                items.append((None, 0, _why(err)))
        if not self.expected:  # the most common structure of the first events (a first odd one does not win)
            counts = collections.Counter(value for _, value, why in items if why is None)
            if counts:
                self.expected = counts.most_common(1)[0][0]
        kept, reasons = [], []
        for payload, value, why in items:
            if why is None and value != self.expected:
                why = (f"another shape or dtype: {self._texts[value]} where the batch has "
                       f"{self._texts.get(self.expected, 'the structure earlier events fixed')}")
            kept.append(DEAD if why else payload)
            reasons.append(why)
        return kept, reasons

    def collate(self, items: list[Any]) -> Any:
        """One batch from kept payloads, with the decoder's batched form when it has one."""
        return self.batch(items) if self.batch is not None else default_collate(items)


def decode_part(decoder: Decoder, events: list[Event], count: int) -> tuple[list[str], Any]:
    """A worker's part of a step: its good events' ids and their batch. ``count`` is how many good events the
    main worker found there (0: a stand-in of weight 0, see :func:`phalanx.stream.plan.split`); raises
    ValueError when this worker finds another number."""
    if decoder.batch is not None and 0 < count == len(events):  # the usual case: decode the part once, in one call
        try:
            batch = decoder.batch([e.fields for e in events])
            if decoder.batch_fits(batch):
                return [e.id for e in events], batch
        except Exception:  # noqa: BLE001 - some event is bad: the checks below find it and say so
            pass
    kept, _ = decoder.check(events)
    good = [(e.id, p) for e, p in zip(events, kept) if p is not DEAD]
    if count == 0:
        return [], decoder.collate([p for _, p in good[:1]])
    if len(good) != count:
        raise ValueError(f"found {len(good)} good events but the main worker claimed {count}")
    return [i for i, _ in good], decoder.collate([p for _, p in good])


def fetch_parts(source: StreamSource, expected: int, rank: int,
                parts: list[tuple[str, str, int]]) -> list[tuple[list[str], Any]]:
    """Worker ``rank``'s parts of several planned steps, fetched and decoded against the structure fingerprint
    ``expected`` the main worker fixed: one task (one thread wake-up), one read per part (each read hands the
    GIL back to the training thread; one pipelined read of all parts held it longer)."""
    decoder, out = Decoder(source.decode, expected), []
    for first, last, count in parts:
        try:
            out.append(decode_part(decoder, source.fetch(first, last), count))
        except ValueError as err:
            raise StreamError(f"worker {rank} {err} in {first}..{last} of stream {source.stream!r}; expected the "
                              "same entries and the same decoding everywhere. Do not delete entries that are not "
                              "yet acknowledged, and make decode deterministic.") from None
    return out
