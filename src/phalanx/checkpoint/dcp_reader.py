"""The checked reader of a checkpoint's DCP files: nothing in them runs code, every byte is verified before use.

DCP's own ``FileSystemReader`` unpickles ``.metadata`` (any class it names) and reads the data files as it finds
them. Ours (:func:`_safe_reader`) keeps DCP's load plan and changes its two reads:

* ``read_metadata``: ``.metadata``'s SHA-256 is checked against the marker, then :class:`_MetadataUnpickler` builds
  DCP's metadata classes and nothing else, and every field loading reads is checked to be there with its type
  (a flipped bit in a field's name builds the classes without that field);
* ``read_data``: each chunk is read through :class:`phalanx.sealed.Opened` (confined to the directory's regular
  files, inside their sizes, its SHA-256 checked, the next chunks read and hashed ahead in threads), loaded with
  ``weights_only=True``, and checked to be the tensor its metadata describes before it is copied into place.

How the checkpoint is laid out and loaded is :mod:`phalanx.checkpoint.dcp`'s.

Example:
    >>> import collections, io, pickle
    >>> _MetadataUnpickler(io.BytesIO(pickle.dumps(collections.Counter()))).load()
    Traceback (most recent call last):
    ...
    _pickle.UnpicklingError: collections.Counter is not part of DCP's metadata
"""
from __future__ import annotations

import functools
import io
import os
import pickle
from typing import Any, Iterator

import torch

from ..errors import CheckpointError
from ..sealed import Opened


def _dcp() -> Any:
    """``torch.distributed.checkpoint``, imported at the first checkpoint rather than with phalanx.

    Why: it pulls DTensor and sympy, 1.3 s of every worker's start-up (``python -X importtime -c 'import phalanx'``),
    and most jobs start many more workers than they write checkpoints.
    """
    import torch.distributed.checkpoint as dcp
    import torch.distributed.checkpoint.state_dict  # noqa: F401 - reached as dcp.state_dict
    return dcp


class _MetadataUnpickler(pickle.Unpickler):
    """Builds DCP's metadata classes and nothing else: a tampered ``.metadata`` cannot run code."""

    ALLOWED = {("torch.distributed.checkpoint.metadata", name) for name in (
        "Metadata", "TensorStorageMetadata", "TensorProperties", "ChunkStorageMetadata", "MetadataIndex",
        "StorageMeta", "_MEM_FORMAT_ENCODING")} | {
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"),
        ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"), ("pathlib", "WindowsPath"),
        ("collections", "OrderedDict")}

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in self.ALLOWED or (module == "torch" and isinstance(getattr(torch, name, None),
                                                                                torch.dtype)):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not part of DCP's metadata")


def _safe_reader(ckpt: Opened) -> Any:
    """DCP's file reader for the opened checkpoint: metadata by :class:`_MetadataUnpickler`, every byte checked."""
    reader = _safe_reader_class()(ckpt.path)
    reader.opened = ckpt
    return reader


@functools.cache
def _safe_reader_class() -> type:
    """The reader's class: it derives from DCP's, which is imported at the first checkpoint (see :func:`_dcp`)."""
    return type("_SafeReader", (_dcp().FileSystemReader,), {"read_metadata": _read_metadata, "read_data": _read_data})


def _read_metadata(self, *args: Any, **kwargs: Any) -> Any:
    ckpt: Opened = self.opened
    where = ckpt.where(".metadata")
    if ".metadata" not in ckpt.files:
        raise CheckpointError(f"{ckpt.path!r} lacks DCP's .metadata; expected a whole checkpoint "
                              "directory. Resume from an earlier checkpoint.")
    data = ckpt.read(".metadata")  # its SHA-256 checked first: a flipped bit is refused, not misread
    try:
        metadata = _MetadataUnpickler(io.BytesIO(data)).load()
    except Exception as err:  # noqa: BLE001 - anything unreadable is one refusal
        raise CheckpointError(f"{where!r} could not be read safely ({type(err).__name__}: "
                              f"{str(err)[:200]}); expected DCP metadata of tensors only. Refusing it: do not "
                              "load checkpoints from untrusted sources.") from None
    problem = _metadata_problem(metadata)
    if problem:  # a flipped bit in a field's name builds the classes without that field
        raise CheckpointError(f"{where!r} is damaged: {problem}; expected the DCP metadata px.save_checkpoint "
                              "writes. Resume from an earlier checkpoint.")
    if not isinstance(metadata, _dcp().metadata.Metadata) or not all(
            isinstance(v, _dcp().metadata.TensorStorageMetadata) for v in metadata.state_dict_metadata.values()) \
            or not isinstance(metadata.storage_data, dict) or not all(
            type(v) is _dcp().filesystem._StorageInfo for v in metadata.storage_data.values()):
        raise CheckpointError(f"{where!r} describes entries other than tensors; expected the metadata "
                              "px.save_checkpoint writes (objects would be unpickled). Refusing it.")
    if getattr(metadata, "storage_meta", None) is None:
        metadata.storage_meta = _dcp().metadata.StorageMeta()
    metadata.storage_meta.load_id = self.load_id
    self.phalanx_metadata = metadata  # read_data checks each chunk's shape against it
    return metadata


def _read_ahead(ckpt: Opened, infos: list[Any], items: list[Any]) -> Iterator[tuple[Any, bytes]]:
    """``(item, its chunk's bytes, checked)`` in order, the next few chunks read and hashed in threads meanwhile
    (hashlib releases the GIL): the check's SHA-256 runs beside the deserialisation instead of before it."""
    from collections import deque
    from concurrent.futures import ThreadPoolExecutor
    window = max(1, min(4, os.cpu_count() or 1))
    with ThreadPoolExecutor(max_workers=window) as pool:
        pending: deque = deque()
        upcoming = iter(zip(items, infos))
        for _ in range(window):
            for req, info in upcoming:
                pending.append((req, pool.submit(ckpt.read_chunk, info.relative_path, info.offset, info.length)))
                break
        while pending:
            req, future = pending.popleft()
            data = future.result()
            for nxt, info in upcoming:
                pending.append((nxt, pool.submit(ckpt.read_chunk, info.relative_path, info.offset, info.length)))
                break
            yield req, data


def _read_data(self, plan: Any, planner: Any) -> Any:
    """DCP's ``read_data``, reading each chunk through the opened checkpoint: confined to its regular files, inside
    their sizes, and checked against the marker's SHA-256 before it is used."""
    ckpt: Opened = self.opened
    items = sorted(plan.items, key=lambda r: (self.storage_data[r.storage_index].relative_path,
                                              self.storage_data[r.storage_index].offset))
    for req in items:
        info = self.storage_data[req.storage_index]
        if info.transform_descriptors or req.type != _dcp().planner.LoadItemType.TENSOR:
            raise CheckpointError(f"{ckpt.path!r}: DCP's metadata asks for a transformed or non-tensor read of "
                                  f"{info.relative_path!r}; expected plain tensors as px.save_checkpoint writes them.")
        ckpt.open_data(info.relative_path)  # here, in this thread: the reads ahead below share the descriptors
    for req, data in _read_ahead(ckpt, [self.storage_data[r.storage_index] for r in items], items):
        info = self.storage_data[req.storage_index]
        where = ckpt.where(info.relative_path)
        try:
            tensor = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
        except Exception as err:  # noqa: BLE001
            raise CheckpointError(f"{where!r} holds a chunk that does not load as a tensor ({type(err).__name__}); "
                                  "expected the data px.save_checkpoint wrote. Refusing it.") from None
        target = planner.resolve_tensor(req).detach()
        meta = self.phalanx_metadata.state_dict_metadata.get(req.storage_index.fqn)
        chunk = next((c for c in getattr(meta, "chunks", ()) if tuple(c.offsets) == tuple(req.storage_index.offset)),
                     None)
        if not isinstance(tensor, torch.Tensor) or chunk is None or tensor.dtype != target.dtype or \
                tuple(tensor.shape) != tuple(chunk.sizes):
            raise CheckpointError(f"{where!r} holds a chunk of {req.storage_index.fqn!r} that is not the tensor its "
                                  "metadata describes (another shape or dtype); expected what px.save_checkpoint "
                                  "wrote. Refusing it.")
        narrowed = tensor
        try:
            for dim, (start, length) in enumerate(zip(req.storage_offsets, req.lengths, strict=True)):
                narrowed = narrowed.narrow(dim, start, length)
        except (RuntimeError, IndexError, ValueError):
            narrowed = None
        if narrowed is None or narrowed.size() != target.size():
            raise CheckpointError(f"{where!r}: the chunk of {req.storage_index.fqn!r} does not hold the part asked "
                                  "for; expected the data px.save_checkpoint wrote. Refusing it.")
        target.copy_(narrowed)
        planner.commit_tensor(req, target)
    fut: torch.futures.Future = torch.futures.Future()  # DCP waits on torch's future, as its own reader returns
    fut.set_result(None)
    return fut


def _metadata_problem(metadata: Any) -> str | None:
    """What in unpickled DCP metadata lacks the fields (and their types) loading reads; None if nothing does."""
    m = _dcp().metadata
    if not isinstance(metadata, m.Metadata):
        return f"it holds a {type(metadata).__name__}, not DCP's Metadata"
    entries = metadata.__dict__.get("state_dict_metadata")
    if not isinstance(entries, dict):
        return "it has no table of tensors (state_dict_metadata)"
    for key, entry in entries.items():
        if not isinstance(key, str):
            return f"a tensor's name is a {type(key).__name__}"
        if not isinstance(entry, m.TensorStorageMetadata):
            continue  # refused below: entries other than tensors
        fields = entry.__dict__
        size, chunks, props = fields.get("size"), fields.get("chunks"), fields.get("properties")
        if not _is_shape(size) or not isinstance(props, m.TensorProperties) or \
                not isinstance(props.__dict__.get("dtype"), torch.dtype) or not isinstance(chunks, list):
            return f"the entry of {key!r} lacks its size, dtype or chunks"
        for chunk in chunks:
            if not isinstance(chunk, m.ChunkStorageMetadata) or not all(
                    _is_shape(chunk.__dict__.get(f)) and len(chunk.__dict__[f]) == len(size)
                    for f in ("offsets", "sizes")):
                return f"a chunk of {key!r} lacks its offsets or sizes"
    storage = metadata.__dict__.get("storage_data")
    if not isinstance(storage, dict):
        return "it has no table of where each chunk is stored (storage_data)"
    info = _dcp().filesystem._StorageInfo
    for index, where in storage.items():
        if not isinstance(index, m.MetadataIndex) or not isinstance(index.__dict__.get("fqn"), str) or \
                not isinstance(where, info) or not isinstance(where.__dict__.get("relative_path"), str) or \
                not all(type(where.__dict__.get(f)) is int for f in ("offset", "length")):
            return "an entry of its storage table lacks its tensor's name, file, offset or length"
    return None


def _is_shape(value: Any) -> bool:
    return isinstance(value, (torch.Size, tuple, list)) and all(type(n) is int and n >= 0 for n in value)
