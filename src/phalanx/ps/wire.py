"""The wire format: a JSON control frame, then typed tensor headers with raw buffers.

Nothing read from the network is unpickled. A message is a list of ZeroMQ frames::

    [prefix...] control  header₁ data₁  header₂ data₂ ...

* ``prefix``: on a request, the job token (empty when the server needs none); the
  server's ROUTER socket adds the sender's routing id in front.
* ``control``: a small JSON object (at most 64 KiB), e.g. ``{"op": "push", "id": 7}``.
* ``header``: a fixed little-endian struct, then the shape and the UTF-8 name::

      magic "PXT1" | dtype code u8 | ndim u8 | reserved u16 (0) | version u64 (< 2^63) | name length u16
      | ndim × i64 dims (>= 0) | name

  Both ends check every field's range (:func:`pack_header` as well as :func:`unpack_header`).

* ``data``: exactly ``numel × itemsize`` bytes, received straight into a fresh tensor
  (``recv_into``), so a frame of the wrong size is refused, never reinterpreted.

A receiver passes ``admit(control, header)``, which checks each header against what it
expects (the server: the registered shard of that name) *before* any tensor is
allocated, so a header claiming 2^40 elements costs nothing but its own bytes.

pyzmq is imported lazily (:func:`require_zmq`): ``import phalanx`` works without it,
and a PS strategy built without it says what to install.

Example:
    >>> h = Header("fc.weight", torch.float32, (4, 2), version=3)
    >>> unpack_header(pack_header(h)) == h
    True
"""
from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Sequence

import torch

from ..errors import ConfigError, PhalanxError, usage

if TYPE_CHECKING:
    import zmq

MAGIC = b"PXT1"
_HEAD = struct.Struct("<4sBBHQH")
MAX_CONTROL_BYTES = 64 * 1024
MAX_NAME_BYTES = 1024
MAX_NDIM = 8
MAX_PREFIX_BYTES = 1024
MAX_VERSION = 2**63 - 1  # versions fit an int64 everywhere; the u64 field's upper half is refused both ways
MAX_DIM = 2**63 - 1

# Codes are part of the protocol: never renumber, only append.
DTYPES: dict[int, torch.dtype] = {1: torch.float32, 2: torch.float64, 3: torch.float16, 4: torch.bfloat16,
                                  5: torch.int64, 6: torch.int32, 7: torch.uint8}
CODES = {dtype: code for code, dtype in DTYPES.items()}


class WireError(PhalanxError, ValueError):
    """A frame that does not follow the protocol (size, magic, dtype, JSON...)."""


def require_zmq() -> Any:
    """The ``zmq`` module, or a :class:`ConfigError` saying how to install it."""
    try:
        import zmq
    except ImportError:
        raise ConfigError(usage("a parameter-server strategy without pyzmq installed",
                                "the pyzmq package (the servers speak ZeroMQ)",
                                "pip install pyzmq (or phalanx[ps]).")) from None
    return zmq


@dataclass(frozen=True)
class Header:
    """What travels in front of every tensor: name, dtype, shape and version."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    version: int = 0

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * self.dtype.itemsize

    @classmethod
    def of(cls, name: str, tensor: torch.Tensor, version: int = 0) -> "Header":
        return cls(name, tensor.dtype, tuple(tensor.shape), version)


def pack_header(h: Header) -> bytes:
    """The header's bytes; raises :class:`WireError` (never ``struct.error``) for a field out of its range, so a
    server answers that request with an error instead of losing the reply."""
    name = h.name.encode()
    if h.dtype not in CODES:
        raise WireError(f"dtype {h.dtype} cannot travel; expected one of {sorted(map(str, CODES))}")
    if len(name) > MAX_NAME_BYTES or len(h.shape) > MAX_NDIM:
        raise WireError(f"tensor {h.name[:80]!r}: name over {MAX_NAME_BYTES} bytes or over {MAX_NDIM} dims")
    _check_ranges(h.name, h.version, h.shape)
    dims = struct.pack(f"<{len(h.shape)}q", *h.shape)
    return _HEAD.pack(MAGIC, CODES[h.dtype], len(h.shape), 0, h.version, len(name)) + dims + name


def unpack_header(buf: bytes) -> Header:
    if len(buf) < _HEAD.size:
        raise WireError(f"tensor header of {len(buf)} bytes; expected at least {_HEAD.size}")
    magic, code, ndim, reserved, version, name_len = _HEAD.unpack_from(buf)
    if magic != MAGIC:
        raise WireError(f"tensor header starts with {magic!r}; expected {MAGIC!r} (another protocol?)")
    if code not in DTYPES:
        raise WireError(f"unknown dtype code {code}; expected one of {sorted(DTYPES)}")
    if reserved:
        raise WireError(f"tensor header with reserved field {reserved}; expected 0 (a newer protocol?)")
    if ndim > MAX_NDIM or name_len > MAX_NAME_BYTES or len(buf) != _HEAD.size + 8 * ndim + name_len:
        raise WireError(f"tensor header of {len(buf)} bytes does not match ndim={ndim}, name length={name_len}")
    shape = struct.unpack_from(f"<{ndim}q", buf, _HEAD.size)
    try:
        name = buf[_HEAD.size + 8 * ndim:].decode()
    except UnicodeDecodeError:
        raise WireError("tensor name is not UTF-8") from None
    _check_ranges(name, version, shape)
    return Header(name, DTYPES[code], tuple(shape), version)


def _check_ranges(name: str, version: Any, shape: Sequence[Any]) -> None:
    """Every numeric field of a header within its range, on the way in and on the way out."""
    if isinstance(version, bool) or not isinstance(version, int) or not 0 <= version <= MAX_VERSION:
        raise WireError(f"tensor {name[:80]!r}: version {version!r}; expected an integer in [0, 2^63 - 1]")
    if any(isinstance(d, bool) or not isinstance(d, int) or not 0 <= d <= MAX_DIM for d in shape):
        raise WireError(f"tensor {name[:80]!r}: shape {list(shape)}; expected dimensions in [0, 2^63 - 1]")


def pack_control(control: dict[str, Any]) -> bytes:
    data = json.dumps(control, separators=(",", ":")).encode()
    if len(data) > MAX_CONTROL_BYTES:
        raise WireError(f"control frame of {len(data)} bytes; the limit is {MAX_CONTROL_BYTES}")
    return data


def unpack_control(buf: bytes) -> dict[str, Any]:
    if len(buf) > MAX_CONTROL_BYTES:
        raise WireError(f"control frame of {len(buf)} bytes; the limit is {MAX_CONTROL_BYTES}")
    try:
        control = json.loads(buf)
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise WireError(f"control frame is not JSON: {err}") from None
    if not isinstance(control, dict):
        raise WireError(f"control frame holds a {type(control).__name__}; expected a JSON object")
    return control


def _payload(tensor: torch.Tensor) -> memoryview:
    """The tensor's bytes without a copy (bfloat16 included: we view it as bytes)."""
    flat = tensor.detach().cpu().contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy())


@dataclass
class Message:
    prefix: list[bytes]
    control: dict[str, Any]
    tensors: list[tuple[Header, torch.Tensor]]
    nbytes: int  # every frame's length, headers and control included


def send_message(sock: "zmq.Socket", control: dict[str, Any], tensors: Sequence[tuple[Header, torch.Tensor]] = (),
                 *, prefix: Sequence[bytes] = ()) -> int:
    """Send one message; returns the bytes put on the wire.

    Tensor frames are sent without copying, so the caller must not change them until
    the peer has answered (every exchange here is request/reply, which guarantees it).
    """
    frames: list[Any] = [*prefix, pack_control(control)]
    for header, tensor in tensors:
        frames += [pack_header(header), _payload(tensor)]
    sock.send_multipart(frames, copy=False)
    return sum(len(f) if isinstance(f, bytes) else f.nbytes for f in frames)


def _drain(sock: "zmq.Socket") -> None:
    while _more(sock):
        sock.recv(copy=False)  # zmq already holds the frame; dropping it frees it


def _more(sock: "zmq.Socket") -> bool:
    return bool(sock.getsockopt(require_zmq().RCVMORE))


Admit = Callable[[dict[str, Any], Header], None]


def recv_message(sock: "zmq.Socket", *, prefix_frames: int = 0, authorize: Any = None,
                 admit: Admit | None = None) -> Message:
    """Receive one whole message; raise :class:`WireError` (after draining it) if it is malformed.

    ``authorize(prefix)`` runs before anything else is parsed or allocated, so an
    unauthenticated peer costs us no more than reading its frames. ``admit(control, header)``
    runs for each tensor header before its tensor is allocated and may raise to refuse it.
    Whatever goes wrong, the rest of the message is drained, so the socket stays in step,
    and the exception carries ``.prefix`` so that a server can still address its reply.
    """
    prefix: list[bytes] = []
    nbytes = 0
    try:
        for i in range(prefix_frames):
            frame = sock.recv()
            nbytes += len(frame)
            if len(frame) > MAX_PREFIX_BYTES or not _more(sock):
                raise WireError(f"message ended or oversized at envelope frame {i}")
            prefix.append(frame)
        if authorize is not None:
            authorize(prefix)
        raw = sock.recv()
        nbytes += len(raw)
        control = unpack_control(raw)
        tensors = []
        while _more(sock):
            raw = sock.recv()
            header = unpack_header(raw)
            if not _more(sock):
                raise WireError(f"tensor {header.name!r} has a header but no data frame")
            if admit is not None:
                admit(control, header)
            tensor = torch.empty(header.shape, dtype=header.dtype)
            got = sock.recv_into(_payload(tensor) if header.nbytes else bytearray())
            if got != header.nbytes:
                raise WireError(f"tensor {header.name!r}: data frame of {got} bytes; header says {header.nbytes} "
                                f"({header.dtype}, shape {list(header.shape)})")
            nbytes += len(raw) + got
            tensors.append((header, tensor))
        return Message(prefix, control, tensors, nbytes)
    except BaseException as err:
        _drain(sock)
        try:
            err.prefix = prefix  # type: ignore[attr-defined]  # so the server can still address its reply
        except AttributeError:  # an exception type that takes no attributes
            pass
        raise
