"""A Redis Stream read through a consumer group: the source behind ``px.stream.RedisStream``.

The main worker is the group's only consumer (``phalanx-main``): it claims
entries in stream order with ``XREADGROUP``, and every worker then fetches its
own slice by id range with ``XRANGE``. Entries are acknowledged (``XACK``) only
once a commit covers them. On recovery the group is rewound to the committed
position with ``XGROUP SETID``; entries a crashed run had claimed after that
position are acknowledged away and read again, in order, so nothing is skipped
and nothing is trained twice in the model's history.

Example (needs a running redis-server; see :mod:`phalanx.stream.broker`)::

    source = px.stream.RedisStream("redis://localhost:6379/0", stream="events", group="trainer",
                                   decode=px.stream.decode_sample)
"""
from __future__ import annotations

import bisect
from typing import Any, Callable, Iterator

from ..errors import ConfigError, usage
from .source import START, Event, StreamError, before, parse_id

CONSUMER = "phalanx-main"  # consumers of a phalanx group are all named phalanx-*


class RedisStream:
    """Events of the Redis Stream ``stream``, read by the consumer group ``group``.

    Args:
        url: ``redis://host:port/db`` or ``unix:///path/to/redis.sock``.
        stream: the stream's key. It must exist unless ``create=True``.
        group: the consumer group; created at the start of the stream if missing.
            A group read by consumers other than phalanx's is refused.
        decode: ``fields -> sample``, e.g. :func:`phalanx.stream.decode_sample`; fields arrive as they were
            sent, with bytes keys and bytes values. An event it raises on, or whose sample has another
            shape or dtype than the batch, goes to the dead-letter stream ``<stream>:dead``, once.
        timeout_s: bound on every call to Redis beyond its own blocking read.
    """

    def __init__(self, url: str, *, stream: str, group: str = "phalanx",
                 decode: Callable[[dict[bytes, bytes]], Any], create: bool = False, timeout_s: float = 5.0) -> None:
        import redis  # here, not at import: `import phalanx` must not need redis

        self._broken = (redis.ConnectionError, redis.TimeoutError, OSError)  # what a lost connection raises
        if not callable(decode):
            raise ConfigError(usage(f"decode={decode!r}", "a function fields -> sample",
                                    "Pass e.g. decode=px.stream.decode_sample."))
        self.url, self.stream, self.group, self.decode = url, stream, group, decode
        self.dead_stream = f"{stream}:dead"
        self.timeout_s = float(timeout_s)
        try:
            self._redis = redis.Redis.from_url(url, socket_timeout=self.timeout_s,
                                               socket_connect_timeout=self.timeout_s)
        except ValueError as err:
            raise ConfigError(usage(f"Redis URL {url!r} ({err})", "redis://host:port/db or unix:///path/redis.sock",
                                    "Fix the URL.")) from None
        # Entries as Redis sends them (hiredis builds the lists in C): redis-py's own parsing makes a dict per
        # entry through several Python calls, a visible share of the loader's time at thousands of events/s.
        for command in ("XREADGROUP", "XRANGE"):
            self._redis.set_response_callback(command, _raw)
        self._call("connecting", self._redis.ping)
        self._claimed: list[str] = []  # claimed and not yet acknowledged, in order
        self._open_group(create)

    # -- setup -----------------------------------------------------------------------------
    def _open_group(self, create: bool) -> None:
        kind = self._call("checking the stream", self._redis.type, self.stream)
        if kind == b"none" and not create:
            raise ConfigError(usage(f"no stream {self.stream!r} at {self.url}", "an existing Redis Stream",
                                    "Check the stream name (and the database in the URL), or pass create=True "
                                    "to wait for a producer that has not started yet."))
        if kind not in (b"none", b"stream"):
            raise ConfigError(usage(f"key {self.stream!r} at {self.url} is a {kind.decode()}", "a Redis Stream",
                                    "Use the key your producer XADDs to."))
        import redis
        try:
            self._call("creating the group", self._redis.xgroup_create, self.stream, self.group, id=START,
                       mkstream=True)
        except redis.ResponseError as err:
            if "BUSYGROUP" not in str(err):
                raise
        consumers = self._call("listing consumers", self._redis.xinfo_consumers, self.stream, self.group)
        foreign = [_text(c["name"]) for c in consumers if not _text(c["name"]).startswith("phalanx-")]
        if foreign:
            raise ConfigError(usage(f"consumer group {self.group!r} on {self.stream!r} at {self.url} is also read "
                                    f"by {', '.join(foreign[:3])}", "a group only phalanx reads",
                                    "Pick another group name: a group's entries go to one consumer each, so "
                                    "another reader would take events away from training."))

    # -- the protocol --------------------------------------------------------------------------
    def rewind(self, position: str | None, offset: int | None = None) -> tuple[str, int | None]:
        """Acknowledge every pending entry and stand the group at ``position`` (see the module doc)."""
        info = self._group_info()
        pending = self._call("reading pending entries", self._redis.xpending, self.stream, self.group)
        if position is None:  # no checkpoint: resume after what earlier runs acknowledged
            last = _text(info["last-delivered-id"])
            position = before(_text(pending["min"])) if pending["pending"] else last
            read = info.get("entries-read")
            offset = 0 if position == START else None if read is None else int(read) - int(pending["pending"])
        for ids in self._pending_ids():
            self._call("acknowledging", self._redis.xack, self.stream, self.group, *ids)
        if position == START:
            offset = 0
        kwargs = {} if offset is None else {"entries_read": offset}
        self._call("rewinding the group", self._redis.xgroup_setid, self.stream, self.group, position, **kwargs)
        self._claimed = []
        return position, offset

    def claim(self, count: int, block_s: float) -> list[Event]:
        block = max(1, int(block_s * 1000)) if block_s > 0 else None  # BLOCK 0 would wait forever
        reply = self._call("reading", self._redis.xreadgroup, self.group, CONSUMER, {self.stream: ">"},
                           count=count, block=block)
        # one stream asked for: its entries (a map of stream to entries in RESP3, a list of pairs in RESP2)
        events = _events(next(iter(reply.values())) if isinstance(reply, dict) else reply[0][1]) if reply else []
        self._claimed.extend(e.id for e in events)
        return events

    def fetch(self, first: str, last: str) -> list[Event]:
        return _events(self._call("fetching", self._redis.xrange, self.stream, min=first, max=last))

    def acknowledge(self, position: str) -> None:
        try:  # a position is almost always a claimed id: found without parsing every id
            n = self._claimed.index(position) + 1
        except ValueError:  # (claimed in order: the ones up to the position, by number, are a prefix)
            n = bisect.bisect_right(self._claimed, parse_id(position), key=parse_id)
        if n:
            self._call("acknowledging", self._redis.xack, self.stream, self.group, *self._claimed[:n])
            del self._claimed[:n]

    def check(self, position: str, offset: int | None = None) -> int:
        info = self._call("reading the stream's info", self._redis.xinfo_stream, self.stream)
        added, length = int(info.get("entries-added") or 0), int(info.get("length") or 0)
        deleted = _text(info.get("max-deleted-entry-id") or START)  # set by XDEL
        # Trimming (XTRIM, MAXLEN) leaves no mark, but it deletes from the head: more deleted entries
        # than the `offset` entries up to the position means some after it are gone too.
        if parse_id(deleted) > parse_id(position) or (offset is not None and added - length > offset):
            first = info.get("first-entry")
            now = _text(first[0]) if first else "(empty)"
            raise StreamError(f"stream {self.stream!r} at {self.url} lost entries that were never trained: "
                              f"{added - length} of its {added} entries were deleted or trimmed, but training had "
                              f"committed only {offset if offset is not None else '?'} (up to {position}); it now "
                              f"starts at {now}. Expected retention to keep every entry after the committed "
                              "position: trim with XTRIM MINID up to the acknowledged position, or raise MAXLEN. "
                              "Restart from an earlier checkpoint, or accept the loss by starting a new group.")
        return added

    def dead_letter(self, event: Event, reason: str) -> None:
        """Add the event to ``<stream>:dead`` under its own entry id, so that reading it again (after a rollback
        or a restart) does not write it twice: Redis refuses an id that is not past the dead stream's last."""
        import redis
        fields = {b"phalanx-id": event.id.encode(), b"phalanx-reason": reason[:500].encode(), **event.fields}
        try:
            self._call("writing a dead letter", self._redis.xadd, self.dead_stream, fields, id=event.id)
        except redis.ResponseError:  # not past the last dead letter: usually this very one, written before
            if not self._call("reading the dead letters", self._redis.xrange, self.dead_stream, min=event.id,
                              max=event.id):  # an earlier event judged bad only now (another decode): add it
                self._call("writing a dead letter", self._redis.xadd, self.dead_stream, fields)

    # -- helpers ---------------------------------------------------------------------------
    def pending(self) -> int:
        """How many claimed entries the broker still holds unacknowledged."""
        return int(self._call("reading pending entries", self._redis.xpending, self.stream, self.group)["pending"])

    def close(self) -> None:
        self._redis.close()

    def _group_info(self) -> dict[str, Any]:
        for g in self._call("reading the group", self._redis.xinfo_groups, self.stream):
            if _text(g["name"]) == self.group:
                return g
        raise StreamError(f"consumer group {self.group!r} on {self.stream!r} at {self.url} disappeared; expected "
                          "it to live as long as training. Do not destroy it while training runs.")

    def _pending_ids(self) -> Iterator[list[str]]:
        while True:
            rows = self._call("reading pending entries", self._redis.xpending_range, self.stream, self.group,
                              min="-", max="+", count=1000)
            if not rows:
                return
            yield [_text(r["message_id"]) for r in rows]

    def _call(self, what: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except self._broken as err:
            raise StreamError(f"Redis at {self.url} did not answer while {what} stream {self.stream!r} "
                              f"({type(err).__name__}: {str(err)[:160]}); expected a running redis-server. "
                              "Start it or fix the URL; training resumes from the last checkpoint.") from None

    def __repr__(self) -> str:
        return f"RedisStream({self.url!r}, stream={self.stream!r}, group={self.group!r})"


def _raw(reply: Any, **_: Any) -> Any:
    return reply


def _events(entries: list[Any]) -> list[Event]:
    """Events from raw stream entries ``[id, [field, value, ...]]`` (``None`` fields: an entry deleted
    while pending, which decodes as a bad event and is dead-lettered)."""
    return [Event(i.decode(), _pairs(f) if f else {}) for i, f in entries]


def _pairs(flat: list[bytes]) -> dict[bytes, bytes]:
    it = iter(flat)
    return dict(zip(it, it))


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
