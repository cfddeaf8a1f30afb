"""Checkpoints that are written atomically and verified on load.

Two kinds:

* ``px.save(model, path)``: the plain ``state_dict`` of the user's module (no
  ``module.`` prefixes), a normal ``torch.save`` file that ``Net().load_state_dict``
  takes as it is.
* ``px.save_checkpoint(path, model, optimizer, ...)``: everything a run needs to
  continue exactly: model, optimizer, strategy state, sampler position, RNG states
  and step. The file carries a SHA-256 of its body and is loaded with
  ``weights_only=True``, so a truncated or tampered file is refused and nothing in
  it can run code.

Example:
    >>> import torch, phalanx as px, tempfile, os
    >>> net = torch.nn.Linear(2, 2)
    >>> path = os.path.join(tempfile.mkdtemp(), "model.pt")
    >>> px.save(net, path); net.load_state_dict(torch.load(path, weights_only=True))
    <All keys matched successfully>
"""
from __future__ import annotations

import hashlib
import io
import os
import random
import tempfile
from collections import OrderedDict
from typing import Any

import numpy as np
import torch
from torch import nn

from . import group
from .errors import CheckpointError, ConfigError, usage
from .wrap import strategy_of, unwrap

MAGIC = b"PHALANX-CKPT-1\n"


def _atomic_write(path: str | os.PathLike, data: bytes) -> None:
    """Write to a temporary file beside ``path``, fsync, then rename over it."""
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".pt", dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            os.fchmod(f.fileno(), 0o666 & ~_umask())  # what open() would give, not mkstemp's 0600
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)  # atomic on POSIX: readers see the old file or the new one
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
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


def _to_bytes(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def save(model: nn.Module, path: str | os.PathLike) -> None:
    """Save the plain model's weights from the main worker only (others return at once).

    Example:
        >>> import torch, phalanx as px, tempfile, os
        >>> px.save(torch.nn.Linear(1, 1), os.path.join(tempfile.mkdtemp(), "m.pt"))
    """
    if group.is_main():
        state = {k: v.detach().cpu() for k, v in unwrap(model).state_dict().items()}
        _atomic_write(path, _to_bytes(state))


def rng_state() -> dict[str, Any]:
    """This worker's RNG states as tensors and plain values (loadable with weights_only)."""
    version, internal, gauss = random.getstate()
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": [version, list(internal), gauss],
                             "numpy": _numpy_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _numpy_state() -> dict[str, Any]:
    name, keys, pos, has_gauss, gauss = np.random.get_state()
    return {"name": name, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
            "has_gauss": int(has_gauss), "gauss": float(gauss)}


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    np_state = state["numpy"]
    np.random.set_state((np_state["name"], np_state["keys"].numpy().astype(np.uint32), np_state["pos"],
                         np_state["has_gauss"], np_state["gauss"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(path: str | os.PathLike, model: nn.Module, optimizer: torch.optim.Optimizer | None = None, *,
                    loader: Any = None, step: int = 0, extra: dict[str, Any] | None = None) -> None:
    """Write a resumable checkpoint (main worker only; call it on every worker).

    Every worker's torch RNG state is kept, and the strategy's shared state plus each
    worker's own part of it (``Strategy.replica_state_dict``). ``extra`` holds the
    caller's own plain values.

    Example:
        >>> import torch, phalanx as px, tempfile, os
        >>> net = torch.nn.Linear(2, 1); opt = torch.optim.SGD(net.parameters(), lr=0.1)
        >>> p = os.path.join(tempfile.mkdtemp(), "ckpt.pt")
        >>> px.save_checkpoint(p, net, opt, step=3); px.load_checkpoint(p, net, opt)["step"]
        3
    """
    from .comm import Comm
    # Each worker's torch generator differs (dropout, augmentation); keep them all.
    torch_rngs = Comm().all_gather(torch.get_rng_state())
    strategy = strategy_of(optimizer) if optimizer is not None else None
    strategy_state = None
    if strategy is not None:  # collective: rank 0's shared state plus each replica's own (residuals...)
        strategy_state = strategy.state_dict()
        if group.world_size() > 1:
            strategy_state["replicas"] = Comm().all_gather_state(_to_cpu(strategy.replica_state_dict()))
    if not group.is_main():
        return
    body = {
        "model": unwrap(model).state_dict(),
        "optimizer": optimizer.state_dict() if optimizer is not None else None,
        "strategy": strategy_state,
        "loader": loader.state_dict() if loader is not None else None,
        "rng": rng_state(),
        "torch_rng_per_rank": torch_rngs,
        "step": int(step),
        "world_size": group.world_size(),
        "extra": extra or {},
    }
    write_verified(path, body)


def _to_cpu(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_cpu(v) for v in obj)
    return obj


def write_verified(path: str | os.PathLike, body: dict[str, Any]) -> None:
    """Atomically write ``body`` (tensors and plain values) framed with its SHA-256; see :func:`read_checkpoint`."""
    _check_plain(body, "checkpoint")
    payload = _to_bytes(body)
    _atomic_write(path, MAGIC + hashlib.sha256(payload).hexdigest().encode() + b"\n" + payload)


_PLAIN = (torch.Tensor, int, float, bool, str, type(None))


def _check_plain(value: Any, where: str) -> None:
    """Refuse, before writing, anything that ``weights_only=True`` would refuse to load back."""
    if isinstance(value, _PLAIN) or isinstance(value, torch.dtype):
        return
    if type(value) in (dict, OrderedDict):
        for key, item in value.items():
            _check_plain(key, f"{where} key {key!r}")
            _check_plain(item, f"{where}[{key!r}]")
    elif type(value) in (list, tuple):
        for i, item in enumerate(value):
            _check_plain(item, f"{where}[{i}]")
    else:
        raise ConfigError(usage(f"{where} holds a value of type {type(value).__name__}",
                                "tensors, numbers, strings, None, and dicts/lists/tuples of them",
                                "Convert it (e.g. to a tensor or a dict of numbers) before saving."))


def read_checkpoint(path: str | os.PathLike) -> dict[str, Any]:
    """Read and verify a checkpoint file without applying it."""
    path = os.fspath(path)
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        raise CheckpointError(f"no checkpoint at {path!r}; expected a file written by px.save_checkpoint. "
                              "Check the path, or start without resuming.") from None
    if not data.startswith(MAGIC):
        raise CheckpointError(f"{path!r} is not a phalanx checkpoint (bad header); expected a file from "
                              "px.save_checkpoint. For px.save files use torch.load(path, weights_only=True).")
    digest, _, payload = data[len(MAGIC):].partition(b"\n")
    if hashlib.sha256(payload).hexdigest().encode() != digest:
        raise CheckpointError(f"{path!r} is truncated or corrupted (SHA-256 mismatch over {len(payload)} bytes); "
                              "expected an intact checkpoint. Resume from an earlier checkpoint.")
    try:
        return torch.load(io.BytesIO(payload), weights_only=True, map_location="cpu")
    except Exception as err:
        raise CheckpointError(f"{path!r} could not be loaded safely ({err}); expected tensors and plain values "
                              "only. Do not load checkpoints from untrusted sources.") from err


def load_checkpoint(path: str | os.PathLike, model: nn.Module, optimizer: torch.optim.Optimizer | None = None, *,
                    loader: Any = None, restore_rng: bool = True) -> dict[str, Any]:
    """Restore what :func:`save_checkpoint` wrote; returns the body (``step``, ``extra``...).

    Every worker reads the file, so it must be on a filesystem they share.
    """
    body = read_checkpoint(path)
    if loader is not None and body["loader"] is not None and body["world_size"] != group.world_size():
        raise CheckpointError(f"{path!r} holds a data position for {body['world_size']} workers but this run has "
                              f"{group.world_size()}; expected the same number of workers, since the global "
                              "batches depend on it. Resume with the same -n, or pass loader=None to restart "
                              "the interrupted epoch.")
    try:
        unwrap(model).load_state_dict(body["model"])
    except RuntimeError as err:
        raise CheckpointError(f"{path!r} holds weights for another model: {str(err).splitlines()[0]}. "
                              "Build the same architecture before loading.") from err
    if optimizer is not None and body["optimizer"] is not None:
        optimizer.load_state_dict(body["optimizer"])
        strategy = strategy_of(optimizer)
        if strategy is not None and body["strategy"] is not None:
            shared = dict(body["strategy"])
            replicas = shared.pop("replicas", None)
            strategy.load_state_dict(shared)
            if replicas and len(replicas) == group.world_size():  # else: rank 0's shared state only
                strategy.load_replica_state_dict(replicas[group.rank()])
    if loader is not None and body["loader"] is not None:
        loader.load_state_dict(body["loader"])
    if restore_rng:
        set_rng_state(body["rng"])
        per_rank = body.get("torch_rng_per_rank") or []
        if group.rank() < len(per_rank):
            torch.set_rng_state(per_rank[group.rank()])
    return body
