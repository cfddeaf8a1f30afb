"""DCP's file writer, each stored chunk hashed (SHA-256) as it is written: the seal need not read the files back.

A checkpoint's marker vouches for every chunk of DCP's data files by its SHA-256 (:mod:`phalanx.sealed`). Reading
each file back to hash it, once every worker has written, moved every byte of the state through memory a second
time, on rank 0, and on two threads: on this machine about a sixth of an asynchronous save's memory traffic, beside
training (``benchmarks/checkpoint_blocking.py``). Here each chunk is hashed from the bytes on their way to the file:
:class:`HashingFileSystemWriter` hands DCP's ``write_data`` streams (:class:`_HashingStream`) that hash what passes
between two of DCP's ``tell()`` calls (DCP asks for the position before and after every item it writes, so those
spans are its chunks), and records each chunk's digest on the chunk's own storage entry (``phalanx_sha256`` on
DCP's ``_StorageInfo``). DCP gathers those entries to rank 0 into ``.metadata``, where the seal
(:func:`phalanx.checkpoint.dcp._seal`) takes them. A chunk whose span was not one hashed span (another writer
class, a serialisation that writes differently) is hashed from the file as before: nothing is left unvouched.

DCP is imported by this module: it is imported at the first save (:func:`.dcp._dcp`), never with phalanx. The class
lives at module level because an asynchronous save pickles its writer to the writer process.

Example:
    >>> import io, hashlib
    >>> s = _HashingStream(io.BytesIO())
    >>> s.tell(); s.write(b"abc"); s.tell(); s.close()
    0
    3
    3
    >>> s.spans[(0, 3)] == hashlib.sha256(b"abc").hexdigest()
    True
"""
from __future__ import annotations

import contextlib
import hashlib
import os
from typing import Any, Iterator

import torch.distributed.checkpoint as dcp
from torch.futures import Future

from .dcp import DIGEST

_SLICE = 1 << 20  # bytes written, then hashed, at a time: within the cache of one core


class _HashingStream:
    """A binary file stream that hashes the bytes written between consecutive ``tell()`` calls.

    ``spans`` maps ``(offset, length)`` of each non-empty span to its SHA-256. The position is counted here (the file
    is opened for writing from its start, as DCP's are), so ``tell()`` needs no system call.
    """

    def __init__(self, raw: Any) -> None:
        self.raw = raw
        self.spans: dict[tuple[int, int], str] = {}
        self._start = self._pos = 0
        self._hash = hashlib.sha256()

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        done = 0
        # In slices: each is hashed while the write's own read of it left it in the CPU's cache, so the hash costs
        # no second pass over memory (torch.save hands a tensor's whole storage in one call).
        while done < len(view):
            part = view[done:done + _SLICE]
            n = self.raw.write(part)
            n = len(part) if n is None else n
            self._hash.update(part[:n] if n != len(part) else part)
            done += n
            if n < len(part):  # a raw stream that took less: what it took, as its write says
                break
        self._pos += done
        return done

    def tell(self) -> int:
        self._cut()
        return self._pos

    def _cut(self) -> None:
        if self._pos > self._start:
            self.spans[(self._start, self._pos - self._start)] = self._hash.hexdigest()
            self._hash = hashlib.sha256()
        self._start = self._pos

    def close(self) -> None:
        self._cut()
        self.raw.close()

    def __getattr__(self, name: str) -> Any:  # flush, fileno, writable...: the file's own
        return getattr(self.raw, name)


class _HashingFileSystem:
    """DCP's ``FileSystem`` whose streams opened for writing hash their spans; ``spans`` by file name."""

    def __init__(self, fs: Any) -> None:
        self.fs = fs
        self.spans: dict[str, dict[tuple[int, int], str]] = {}

    @contextlib.contextmanager
    def create_stream(self, path: Any, mode: str) -> Iterator[Any]:
        with self.fs.create_stream(path, mode) as raw:
            if mode != "wb":
                yield raw
                return
            stream = _HashingStream(raw)
            try:
                yield stream
            finally:
                stream._cut()  # (DCP closes it itself; a failed write leaves no digest that matters)
                self.spans[os.path.basename(os.fspath(path))] = stream.spans

    def __getattr__(self, name: str) -> Any:
        return getattr(self.fs, name)


class HashingFileSystemWriter(dcp.FileSystemWriter):
    """``FileSystemWriter`` whose ``write_data`` records each written chunk's SHA-256 on its storage entry.

    Example:
        >>> import tempfile, torch, torch.distributed.checkpoint as dcp
        >>> d = tempfile.mkdtemp()
        >>> dcp.save({"w": torch.ones(3)}, storage_writer=HashingFileSystemWriter(d), no_dist=True) and None
        >>> info = next(iter(dcp.FileSystemReader(d).read_metadata().storage_data.values()))
        >>> len(getattr(info, DIGEST))
        64
    """

    def write_data(self, plan: Any, planner: Any) -> Future:
        real = self.fs
        hashing = self.fs = _HashingFileSystem(real)
        try:
            results = super().write_data(plan, planner).wait()  # (DCP's file writer is done when it returns)
        finally:
            self.fs = real
        for result in results:
            info = result.storage_data
            digest = hashing.spans.get(os.path.basename(str(info.relative_path)), {}).get((info.offset, info.length))
            if digest is not None:
                setattr(info, DIGEST, digest)
        done: Future = Future()
        done.set_result(results)
        return done


__all__ = ["DIGEST", "HashingFileSystemWriter"]
