"""Files that are written atomically, framed with their SHA-256, and read back safely.

A leaf module (it imports nothing from phalanx but :mod:`phalanx.errors`), so the
training-side checkpoints and the parameter-server shard store share one format
without importing each other.

A framed file is ``MAGIC``, the hex SHA-256 of the body, a newline, and the body:
a ``torch.save`` of tensors and plain values. Reading checks the digest, then loads
with ``weights_only=True``: a truncated or tampered file is refused, and nothing
in it can run code.

A checkpoint directory (:mod:`phalanx.checkpoint`) is vouched for by its marker, which lists
each file's size and SHA-256 (data files per chunk): :class:`phalanx.sealed.Opened` reads such a directory
through one descriptor and uses no byte the marker does not vouch for.

Writing goes to a temporary file beside the target, is fsynced, then renamed over
it, so readers see the old file or the new one, never half of one. A writer killed
mid-save (kill -9) leaves its temporary behind; the next save to the same path
removes the temporaries of writers on this host that are no longer running.

Example:
    >>> import os, tempfile, torch
    >>> from phalanx.framing import read_verified, write_verified
    >>> path = os.path.join(tempfile.mkdtemp(), "state.pt")
    >>> write_verified(path, {"w": torch.ones(2), "step": 3})
    >>> read_verified(path)["step"]
    3
"""
from __future__ import annotations

import errno
import glob
import hashlib
import io
import os
import re
import socket
import tempfile
from collections import OrderedDict
from typing import Any

import torch

from .errors import CheckpointError, ConfigError, usage

MAGIC = b"PHALANX-CKPT-1\n"
# Written last into a complete checkpoint directory (phalanx.checkpoint): here, with the file format, so that
# phalanx.step.preempt can tell a complete checkpoint without importing the checkpoint code (which imports the clock).
MARKER = "phalanx.json"


def _temp_prefix(path: str) -> str:
    """``.<name>.tmp-<host>-`` : temporaries are found by the file they were for and the host that wrote them."""
    return f".{os.path.basename(path)}.tmp-{socket.gethostname()}-"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's live process
        return True
    return True


def clean_stale_temporaries(path: str | os.PathLike) -> list[str]:
    """Remove temporaries left beside ``path`` by writers on this host that died mid-save; returns them.

    A temporary is named ``.<file>.tmp-<host>-<pid>-<random>``; one whose process is
    still running (another thread of this process, or a live writer) is left alone.
    """
    path = os.path.abspath(os.fspath(path))
    prefix = _temp_prefix(path)
    removed = []
    for tmp in glob.glob(os.path.join(glob.escape(os.path.dirname(path)), glob.escape(prefix) + "*")):
        match = re.match(r"(\d+)-", os.path.basename(tmp)[len(prefix):])
        if match is None or int(match.group(1)) == os.getpid() or _alive(int(match.group(1))):
            continue
        try:
            os.unlink(tmp)
            removed.append(tmp)
        except FileNotFoundError:  # another writer cleaned it first
            pass
    return removed


def atomic_write(path: str | os.PathLike, data: bytes) -> None:
    """Write ``data`` to a temporary file beside ``path``, fsync, then rename it over ``path``.

    Refuses with a :class:`CheckpointError` naming the path when the disk is full.
    """
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    clean_stale_temporaries(path)
    fd, tmp = tempfile.mkstemp(prefix=f"{_temp_prefix(path)}{os.getpid()}-", dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            os.fchmod(f.fileno(), 0o666 & ~_umask())  # what open() would give, not mkstemp's 0600
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)  # atomic on POSIX: readers see the old file or the new one
    except BaseException as err:
        if os.path.exists(tmp):
            os.unlink(tmp)
        if isinstance(err, OSError) and err.errno in (errno.ENOSPC, errno.EFBIG, errno.EDQUOT):
            raise CheckpointError(
                f"could not write {path!r}: {os.strerror(err.errno)} ({errno.errorcode[err.errno]}) after "
                f"writing part of {len(data):,} bytes; expected room for the whole file. The previous file at "
                "that path is untouched: free space or save elsewhere.") from err
        raise
    dir_fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(dir_fd)  # make the rename itself durable
    finally:
        os.close(dir_fd)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def to_bytes(obj: Any) -> bytes:
    """``torch.save`` into bytes."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def from_bytes(data: bytes, what: str = "data") -> Any:
    """``torch.load(weights_only=True)`` from bytes: tensors and plain containers only, nothing runs."""
    try:
        return torch.load(io.BytesIO(data), weights_only=True, map_location="cpu")
    except Exception as err:
        raise CheckpointError(f"{what} could not be loaded safely ({_refusal(err)}); expected tensors and plain "
                              "values only. Refusing it: do not load checkpoints from untrusted sources.") from err


def _refusal(err: BaseException) -> str:
    """The cause of a refused load in a few words, without torch's advice to turn the safety off."""
    text = str(err)
    found = re.search(r"Unsupported (global|operand):? ?(GLOBAL )?[^\s]*", text)
    if found:
        return "it holds Python objects that loading would execute: " + found.group(0).strip()
    first = next((line.strip() for line in text.splitlines() if line.strip() and "weights_only" not in line), "")
    return f"{type(err).__name__}: {first[:200]}" if first else type(err).__name__


def write_verified(path: str | os.PathLike, body: dict[str, Any]) -> None:
    """Atomically write ``body`` (tensors and plain values) framed with its SHA-256; see :func:`read_verified`."""
    check_plain(body, "checkpoint")
    payload = to_bytes(body)
    atomic_write(path, MAGIC + hashlib.sha256(payload).hexdigest().encode() + b"\n" + payload)


def read_verified(path: str | os.PathLike) -> dict[str, Any]:
    """Read a framed file, check its SHA-256, and load it with ``weights_only=True``."""
    path = os.fspath(path)
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        raise CheckpointError(f"no checkpoint at {path!r}; expected a file written by px.save_checkpoint. "
                              "Check the path, or start without resuming.") from None
    return unframe(data, path)


def unframe(data: bytes, path: str | os.PathLike) -> dict[str, Any]:
    """The body of a framed file's bytes ``data`` (read from ``path``): its SHA-256 checked, loaded weights-only.

    Example:
        >>> body = to_bytes({"a": 1})
        >>> unframe(MAGIC + hashlib.sha256(body).hexdigest().encode() + b"\\n" + body, "f")
        {'a': 1}
    """
    path = os.fspath(path)
    if not data.startswith(MAGIC):
        raise CheckpointError(f"{path!r} is not a phalanx checkpoint (bad header); expected a file from "
                              "px.save_checkpoint. For px.save files use torch.load(path, weights_only=True).")
    digest, _, payload = data[len(MAGIC):].partition(b"\n")
    if hashlib.sha256(payload).hexdigest().encode() != digest:
        raise CheckpointError(f"{path!r} is truncated or corrupted (SHA-256 mismatch over {len(payload)} bytes); "
                              "expected an intact checkpoint. Resume from an earlier checkpoint.")
    return from_bytes(payload, repr(path))


_PLAIN = (torch.Tensor, int, float, bool, str, type(None))


def check_plain(value: Any, where: str) -> None:
    """Refuse, before writing, anything that ``weights_only=True`` would refuse to load back."""
    if isinstance(value, _PLAIN) or isinstance(value, torch.dtype):
        return
    if type(value) in (dict, OrderedDict):
        for key, item in value.items():
            check_plain(key, f"{where} key {key!r}")
            check_plain(item, f"{where}[{key!r}]")
    elif type(value) in (list, tuple):
        for i, item in enumerate(value):
            check_plain(item, f"{where}[{i}]")
    else:
        raise ConfigError(usage(f"{where} holds a value of type {type(value).__name__}",
                                "tensors, numbers, strings, None, and dicts/lists/tuples of them",
                                "Convert it (e.g. to a tensor or a dict of numbers) before saving."))


__all__ = ["MAGIC", "MARKER", "atomic_write", "check_plain", "clean_stale_temporaries", "from_bytes",
           "read_verified", "to_bytes", "unframe", "write_verified"]
