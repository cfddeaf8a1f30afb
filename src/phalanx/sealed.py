"""A checkpoint directory sealed by its marker: every file's size and SHA-256 (per stored chunk for data files)
recorded in ``phalanx.json``, and read back through one directory descriptor with every byte checked before use.

:mod:`phalanx.framing` frames one file; this module seals and opens a directory of them. A reader opens the
directory once (:class:`Opened`), so a save that renames a new checkpoint over the path meanwhile changes nothing
it reads; names are plain (no ``/``, no ``..``), files regular, offsets and sizes checked against the marker.

Example:
    >>> import tempfile, os
    >>> d = tempfile.mkdtemp(); open(os.path.join(d, "a"), "wb").write(b"x")
    1
    >>> sorted(digest_files(d, {"a": None})["a"])
    ['sha256', 'size']
"""
from __future__ import annotations
import errno
import hashlib
import json
import os
import re
import stat
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Iterable
from .errors import CheckpointError
from .framing import MARKER, atomic_write

# -- a checkpoint directory: its marker vouches for every file ----------------------------------------------------
# What a checkpoint directory's marker vouches for, and reading its files so that nothing unvouched is used.
#
# The marker (``phalanx.json``, written last by rank 0) lists every file of the checkpoint
# with its size and SHA-256: whole for the small files (DCP's ``.metadata``, each worker's
# ``rank-<r>.pt``), per stored chunk for DCP's data files (``__<r>_<n>.distcp``), and carries
# a SHA-256 of itself. A reader (:class:`phalanx.sealed.Opened`):
#
# * opens the directory once and every file relative to that descriptor, so a save that
#   renames a new checkpoint over the path while it reads changes nothing it sees (it reads
#   one checkpoint; if the one it opened is removed under it, :class:`phalanx.sealed.Vanished` says so and
#   the caller starts again on the new one);
# * opens only plain names the marker lists (no ``/``, no ``..``), never following a symlink,
#   non-blocking, and only regular files: a FIFO or a link out of the directory is refused,
#   never waited on;
# * checks every byte it hands on (a small file whole, a data chunk as it is read) against the
#   marker's digest, and every offset and length against the file's size, before anything
#   is applied.


_BLOCK = 8 << 20  # hashed in blocks of 8 MiB: bounded memory whatever a file's size
_NAME = re.compile(r"\.metadata|[A-Za-z0-9_][A-Za-z0-9_.-]{0,200}")  # a plain name in the directory, nothing else


def _pread(fd: int, length: int, offset: int) -> bytes:
    """``length`` bytes at ``offset`` (fewer only where the file ends): one read returns at most ~2 GiB on Linux."""
    parts = []
    while length > 0:
        block = os.pread(fd, min(length, 1 << 30), offset)
        if not block:
            break
        parts.append(block)
        offset += len(block)
        length -= len(block)
    return parts[0] if len(parts) == 1 else b"".join(parts)


def _hash_range(fd: int, offset: int, length: int) -> str:
    """SHA-256 of ``length`` bytes at ``offset`` of the open file ``fd`` (short: the file ended first)."""
    h = hashlib.sha256()
    while length > 0:
        block = os.pread(fd, min(_BLOCK, length), offset)
        if not block:
            raise EOFError
        h.update(block)  # hashlib releases the GIL for large blocks: files hash in parallel threads
        offset += len(block)
        length -= len(block)
    return h.hexdigest()


def digest_file(directory: str, name: str, chunks: Iterable[tuple[int, int]] | None = None) -> dict[str, Any]:
    """The marker's entry for ``directory/name``: its size, and its SHA-256 (whole, or per ``(offset, length)`` chunk).

    Example:
        >>> import tempfile, os
        >>> d = tempfile.mkdtemp(); open(os.path.join(d, "f"), "wb").write(b"abcd")
        4
        >>> digest_file(d, "f", [(0, 2)])["chunks"][0][:2]
        [0, 2]
    """
    fd = os.open(os.path.join(directory, name), os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        if chunks is None:
            return {"size": size, "sha256": _hash_range(fd, 0, size)}
        return {"size": size, "chunks": [[o, n, _hash_range(fd, o, n)] for o, n in sorted(set(chunks))]}
    finally:
        os.close(fd)


def digest_files(directory: str, wanted: dict[str, list[tuple[int, int]] | None],
                 known: dict[tuple[str, int, int], str] | None = None) -> dict[str, dict[str, Any]]:
    """:func:`digest_file` for each name of ``wanted`` (``None``: the whole file); chunks hash in parallel threads.

    ``known``: digests of ``(name, offset, length)`` chunks taken as they were written
    (:mod:`phalanx.checkpoint.hashing`): not read again, once each lies within its file.
    """
    known = known or {}

    def one(task: tuple[str, int, int]) -> str:
        name, offset, length = task
        fd = os.open(os.path.join(directory, name), os.O_RDONLY)
        try:
            return _hash_range(fd, offset, length)
        finally:
            os.close(fd)

    sizes = {name: os.path.getsize(os.path.join(directory, name)) for name in wanted}
    tasks = [(name, o, n) for name, chunks in wanted.items()
             for o, n in (sorted(set(chunks)) if chunks is not None else [(0, sizes[name])])]
    if any(o + n > sizes[name] for name, o, n in tasks if (name, o, n) in known):
        raise EOFError  # a file shorter than what was written into it, as reading it back finds
    todo = [task for task in tasks if task not in known]
    with ThreadPoolExecutor(max_workers=max(1, min(4, os.cpu_count() or 1, len(todo)))) as pool:
        digests = {**known, **dict(zip(todo, pool.map(one, todo)))}
    return {name: {"size": sizes[name], "sha256": digests[(name, 0, sizes[name])]} if chunks is None else
            {"size": sizes[name], "chunks": [[o, n, digests[(name, o, n)]] for o, n in sorted(set(chunks))]}
            for name, chunks in wanted.items()}


def _self_digest(body: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def write_marker(directory: str, header: dict[str, Any], files: dict[str, dict[str, Any]]) -> None:
    """Write the marker: ``header`` (format, world size, step), the ``files`` it vouches for, its own SHA-256."""
    body = {**header, "files": files}
    atomic_write(os.path.join(directory, MARKER), json.dumps({**body, "sha256": _self_digest(body)}).encode())


def parse_marker(data: bytes, path: str) -> dict[str, Any]:
    """The marker's JSON, its own digest and its list of files checked; raises a CheckpointError naming ``path``."""
    try:
        marker = json.loads(data.decode())
    except ValueError as err:
        raise CheckpointError(f"{path!r} has a damaged {MARKER} ({err}); expected the JSON px.save_checkpoint "
                              "writes. Resume from an earlier checkpoint.") from None
    if not isinstance(marker, dict):
        raise CheckpointError(f"{path!r} has a {MARKER} that is not phalanx's ({str(marker)[:120]}); expected a JSON "
                              "object. Resume from a checkpoint px.save_checkpoint wrote, unedited.")
    body = {k: v for k, v in marker.items() if k != "sha256"}
    if "files" not in marker:
        raise CheckpointError(f"{path!r} has a {MARKER} without the checksums of its files (written before "
                              "checkpoints were verified, or edited); expected one listing every file. Load it with "
                              "the phalanx that wrote it and save it again, or resume from another checkpoint.")
    if marker.get("sha256") != _self_digest(body):
        raise CheckpointError(f"{os.path.join(path, MARKER)!r} is corrupted or edited (its SHA-256 does not match); "
                              "expected the marker px.save_checkpoint wrote. Resume from an earlier checkpoint.")
    files = marker["files"]
    ok = isinstance(files, dict) and all(
        isinstance(name, str) and _NAME.fullmatch(name) and name != MARKER and isinstance(e, dict)
        and _count(e.get("size")) and (_hex(e.get("sha256")) or isinstance(e.get("chunks"), list) and all(
            isinstance(c, list) and len(c) == 3 and _count(c[0]) and _count(c[1]) and _hex(c[2])
            and c[0] + c[1] <= e["size"] for c in e["chunks"]))
        for name, e in files.items())
    if not ok:
        raise CheckpointError(f"{path!r} has a {MARKER} whose list of files is not phalanx's; expected plain names "
                              "in the directory with sizes and SHA-256 digests. Resume from a checkpoint "
                              "px.save_checkpoint wrote, unedited.")
    return marker


def _matches(data: bytes, digest: str) -> bool:
    """Whether ``data`` has the SHA-256 ``digest`` (benchmarks/checkpoint_verify.py replaces it to time a load
    without the check)."""
    return hashlib.sha256(data).hexdigest() == digest


def _count(x: Any) -> bool:
    return type(x) is int and x >= 0


def _hex(x: Any) -> bool:
    return isinstance(x, str) and re.fullmatch(r"[0-9a-f]{64}", x) is not None


class Vanished(CheckpointError):
    """A file of the opened checkpoint is gone: a newer save replaced it while it was read (read the new one)."""


class Opened:
    """A checkpoint directory opened once; every file is read through it and checked against the marker.

    ``replaced()`` says whether ``path`` names another directory now (a save renamed a new one over it).

    Example:
        >>> import os, tempfile
        >>> d = tempfile.mkdtemp(); n = open(os.path.join(d, "rank-0.pt"), "wb").write(b"abc")
        >>> write_marker(d, {"format": "x", "world_size": 1, "step": 0}, {"rank-0.pt": digest_file(d, "rank-0.pt")})
        >>> with Opened(d) as c:
        ...     c.read("rank-0.pt")
        b'abc'
    """

    def __init__(self, path: str) -> None:
        self.path = path
        try:
            self.fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
        except FileNotFoundError:
            raise Vanished(f"no checkpoint at {path!r}; expected a directory px.save_checkpoint wrote. Check the "
                           "path, or start without resuming.") from None
        except OSError as err:
            raise CheckpointError(f"{path!r} could not be opened as a checkpoint directory ({err.strerror}); "
                                  "expected a directory px.save_checkpoint wrote.") from None
        self._ino = os.fstat(self.fd).st_ino
        self._fds: dict[str, int] = {}
        try:
            data = self._read_raw(MARKER, limit=64 << 20)
        except Vanished:
            if self.replaced():
                self.close()
                raise
            self.close()
            raise CheckpointError(f"{path!r} is not a complete phalanx checkpoint (it lacks {MARKER}, written "
                                  "last); expected a directory px.save_checkpoint finished. Resume from an earlier "
                                  "checkpoint.") from None
        except BaseException:
            self.close()
            raise
        try:
            self.marker = parse_marker(data, path)
        except BaseException:
            self.close()
            raise
        self.files: dict[str, dict[str, Any]] = self.marker["files"]
        self._chunks = {name: {(o, n): h for o, n, h in e.get("chunks", ())} for name, e in self.files.items()}

    def __enter__(self) -> "Opened":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def replaced(self) -> bool:
        """True when ``path`` no longer names the directory opened (renamed away, or another renamed over it)."""
        try:
            return os.stat(self.path).st_ino != self._ino
        except OSError:
            return True

    def where(self, name: str) -> str:
        return os.path.join(self.path, name)

    def _open(self, name: str) -> int:
        """``name`` in the directory: a plain name, not a link, a regular file (a FIFO is never waited on)."""
        fd = self._fds.get(name)
        if fd is not None:
            return fd
        if not _NAME.fullmatch(name):
            raise CheckpointError(f"{self.path!r} names the file {name!r}, which is not a plain name in the "
                                  "checkpoint directory; expected DCP's own file names. Refusing it: do not load "
                                  "checkpoints from untrusted sources.")
        try:
            fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY, dir_fd=self.fd)
        except FileNotFoundError:
            raise Vanished(f"{self.where(name)!r} is missing; expected every file the checkpoint's {MARKER} lists. "
                           "Resume from an earlier checkpoint.") from None
        except OSError as err:
            what = "a symbolic link" if err.errno == errno.ELOOP else err.strerror
            raise CheckpointError(f"{self.where(name)!r} could not be opened ({what}); expected a regular file in "
                                  "the checkpoint directory. Refusing it.") from None
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise CheckpointError(f"{self.where(name)!r} is not a regular file (a FIFO, device or directory); "
                                  "expected a file px.save_checkpoint wrote. Refusing it: do not load checkpoints "
                                  "from untrusted sources.")
        self._fds[name] = fd
        return fd

    def _read_raw(self, name: str, limit: int) -> bytes:
        fd = self._open(name)
        size = os.fstat(fd).st_size
        if size > limit:
            raise CheckpointError(f"{self.where(name)!r} is {size:,} bytes; expected at most {limit:,}. Refusing it.")
        return _pread(fd, size, 0)

    def _entry(self, name: str) -> dict[str, Any]:
        entry = self.files.get(name)
        if entry is None:
            raise CheckpointError(f"{self.where(name)!r} is not among the files the checkpoint's {MARKER} vouches "
                                  "for; expected only files px.save_checkpoint wrote. Refusing it.")
        fd = self._open(name)
        size = os.fstat(fd).st_size
        if size != entry["size"]:
            raise CheckpointError(f"{self.where(name)!r} is truncated or altered: {size:,} bytes where "
                                  f"{entry['size']:,} were written. Resume from an earlier checkpoint.")
        return entry

    def read(self, name: str) -> bytes:
        """The whole file ``name``, checked against the marker's size and SHA-256."""
        entry = self._entry(name)
        if "sha256" not in entry:
            raise CheckpointError(f"{self.where(name)!r} is recorded per chunk, not whole; expected a small file.")
        data = _pread(self._open(name), entry["size"], 0)
        if len(data) != entry["size"] or not _matches(data, entry["sha256"]):
            raise CheckpointError(f"{self.where(name)!r} is corrupted (SHA-256 mismatch over {len(data):,} bytes); "
                                  "expected the file px.save_checkpoint wrote. Resume from an earlier checkpoint.")
        return data

    def open_data(self, name: str) -> None:
        """Open the data file ``name`` now (checked as :meth:`read_chunk` would), so that reads from threads find it."""
        self._entry(name)

    def read_chunk(self, name: str, offset: Any, length: Any) -> bytes:
        """``length`` bytes at ``offset`` of the data file ``name``: a chunk the marker lists, checked."""
        entry = self._entry(name)
        if not (_count(offset) and _count(length)) or offset + length > entry["size"]:
            raise CheckpointError(f"{self.path!r}: DCP's metadata places a chunk at bytes {offset}+{length} of "
                                  f"{name!r}, which holds {entry['size']:,}; expected chunks inside the file. "
                                  "Refusing it.")
        digest = self._chunks[name].get((offset, length))
        if digest is None:
            raise CheckpointError(f"{self.path!r}: DCP's metadata reads bytes {offset}+{length} of {name!r}, a chunk "
                                  f"its {MARKER} does not list; expected the chunks px.save_checkpoint wrote. "
                                  "Refusing it.")
        data = _pread(self._open(name), length, offset)
        if len(data) != length or not _matches(data, digest):
            raise CheckpointError(f"{self.where(name)!r} is corrupted (SHA-256 mismatch in the chunk at byte "
                                  f"{offset:,}, {length:,} bytes); expected the data px.save_checkpoint wrote. "
                                  "Resume from an earlier checkpoint.")
        return data

    def verify_all(self) -> None:
        """Check every file the marker lists, every byte (what ``--resume-from auto`` asks of a candidate)."""
        def one(name: str) -> None:
            entry = self._entry(name)
            if "sha256" in entry:
                self.read(name)
            fd = self._open(name)
            for offset, length, digest in entry.get("chunks", ()):
                try:
                    same = _hash_range(fd, offset, length) == digest  # streamed: a chunk may be gigabytes
                except EOFError:
                    same = False
                if not same:
                    raise CheckpointError(f"{self.where(name)!r} is corrupted (SHA-256 mismatch in the chunk at "
                                          f"byte {offset:,}, {length:,} bytes); expected the data "
                                          "px.save_checkpoint wrote. Resume from an earlier checkpoint.")
        for name in self.files:  # opened here, in one thread: the descriptor table is not shared mid-update
            self._entry(name)
        with ThreadPoolExecutor(max_workers=max(1, min(4, os.cpu_count() or 1, len(self.files)))) as pool:
            list(pool.map(one, self.files))


def verify_directory(path: str) -> dict[str, Any]:
    """Check every file of the checkpoint directory ``path``, every byte; returns its marker or raises CheckpointError.

    What ``--resume-from auto`` asks of a candidate (:func:`phalanx.step.preempt.latest_checkpoint`): the
    marker's own digest, DCP's ``.metadata`` and every worker's file listed, and each file and chunk it
    lists present, of its size and SHA-256.

    Example:
        >>> try:
        ...     verify_directory("/nonexistent/ckpt")
        ... except CheckpointError:
        ...     print("refused")
        refused
    """
    with Opened(path) as ckpt:
        world = ckpt.marker.get("world_size")
        if type(world) is not int or world < 1:
            raise CheckpointError(f"{path!r} has a {MARKER} without a world size; expected the marker "
                                  "px.save_checkpoint writes. Resume from an earlier checkpoint.")
        lacking = [n for n in [".metadata", *(f"rank-{r}.pt" for r in range(world))] if n not in ckpt.files]
        if lacking:
            raise CheckpointError(f"{path!r} lacks {', '.join(lacking[:5])} in its {MARKER}; expected every "
                                  "worker's part. Resume from an earlier checkpoint.")
        ckpt.verify_all()
        return ckpt.marker


__all__ = ["Opened", "Vanished", "digest_file", "digest_files", "parse_marker", "verify_directory", "write_marker"]
