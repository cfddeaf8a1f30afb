"""Loading: ``px.load_checkpoint``, ``px.read_checkpoint``, ``phalanx export`` and :func:`checkpoint_step`.

Each finds the checkpoint first (:func:`~phalanx.checkpoint.handle._resolve`: the one at
the path, or the previous one beside it when a save was killed between its renames),
then reads a directory (:mod:`~phalanx.checkpoint.dcp`) or a one-file checkpoint of an
earlier version (:mod:`~phalanx.checkpoint.legacy`). Not collective; nothing in the
files runs code.
"""
from __future__ import annotations

import contextlib
import errno
import os
from typing import Any, Callable, Iterator, TypeVar

import torch
from torch import nn

from ..errors import CheckpointError
from ..framing import MARKER, atomic_write, read_verified, to_bytes
from ..sealed import Opened, Vanished
from .training_state import TrainingState
from .agreement import _remove_abandoned
from .dcp import DCP_FORMAT, _join, _load_directory, _load_whole, _marker, _read_marker, _read_rank_file, _refs
from .handle import _resolve
from .legacy import _load_file, _model_state

T = TypeVar("T")
READ_ATTEMPTS = 5  # a checkpoint replaced under a reader this many times in a row is refused, not read half


def _consistently(path: str | os.PathLike, directory: Callable[[Opened], T], file: Callable[[str], T]) -> T:
    """``directory(opened)`` on the checkpoint at ``path`` (``file(path)`` for a one-file one), all from one save.

    Every file is read through one open directory; if a save renamed a new checkpoint over the path and the old one
    was removed while it was read (a file vanished), it starts again on the new one, before anything is applied.
    """
    for _ in range(READ_ATTEMPTS):
        found = _resolve(os.fspath(path))
        if not os.path.isdir(found):
            try:
                return file(found)
            except (IsADirectoryError, FileNotFoundError):
                # Looked while a save was between its renames (nothing at the path, or only its old copy, then
                # removed), read after its directory landed: the path changed under the reader. Find it again.
                if not os.path.lexists(os.fspath(path)):
                    raise
                continue
        try:
            ckpt = Opened(found)
        except Vanished:  # gone between finding and opening it: a save replaced it; find it again
            continue
        with ckpt:
            try:
                return directory(ckpt)
            except Vanished:
                if not ckpt.replaced():  # a file missing from a directory still in place: damaged, say so
                    raise
    raise CheckpointError(f"{os.fspath(path)!r} was replaced by a newer save {READ_ATTEMPTS} times while it was "
                          "being read; expected a checkpoint that stays in place for one read. Read it again once "
                          "the saves pause, or copy it first.")


def load_checkpoint(path: str | os.PathLike, model: nn.Module, optimizer: torch.optim.Optimizer | None = None, *,
                    loader: Any = None, restore_rng: bool = True, scheduler: Any = None,
                    scaler: Any = None) -> dict[str, Any]:
    """Restore what :func:`~phalanx.checkpoint.save_checkpoint` wrote; returns ``{"step", "extra", "world_size"}``.

    On the number of workers that saved it, each worker takes its own state back. On
    another number, DCP reshards the model and optimizer onto this run's layout (a
    sharded model's shards are re-cut; a checkpoint of a sharded model loads into a plain
    one and back) and every worker takes rank 0's strategy state and data position (the
    rest of the epoch is re-split over the workers there are now); a warning says what
    does not carry over. A checkpoint of another model is refused with one
    :class:`CheckpointError` naming the keys that differ, before anything is changed.
    Every worker reads the directory, so it must be on a filesystem they share. Not
    collective. One-file checkpoints of earlier versions load too.
    """
    state = TrainingState(model, optimizer, loader=loader, scheduler=scheduler, scaler=scaler)
    body = load_state(path, state, restore_rng=restore_rng)
    return {"step": state.step, "extra": state.extra, "world_size": body["world_size"]}


def load_state(path: str | os.PathLike, state: TrainingState, *, restore_rng: bool = True) -> dict[str, Any]:
    """Restore ``state`` from a checkpoint (this worker's part, or rank 0's shared part); returns its summary."""
    with _os_errors_refused(path):
        with contextlib.suppress(OSError):  # housekeeping: what a save killed half-way left (elastic: a lost worker)
            _remove_abandoned(os.path.abspath(os.fspath(path)))
        return _consistently(path, lambda ckpt: _load_directory(ckpt, state, restore_rng=restore_rng),
                             lambda found: _load_file(found, state, restore_rng=restore_rng))


@contextlib.contextmanager
def _os_errors_refused(path: str | os.PathLike) -> Iterator[None]:
    """An OS error while reading a checkpoint (a symbolic link loop, a file it may not read) is one CheckpointError."""
    try:
        yield
    except OSError as err:
        if err.errno is None:
            raise
        raise CheckpointError(f"{os.fspath(path)!r} could not be read: {os.strerror(err.errno)} "
                              f"({errno.errorcode.get(err.errno, err.errno)}) at {err.filename!r}; expected a "
                              "checkpoint px.save_checkpoint wrote, readable. Check the path.") from None


def read_checkpoint(path: str | os.PathLike) -> dict[str, Any]:
    """A checkpoint as plain data: ``{"format", "world_size", "step", "extra", "ranks"}``; nothing runs.

    For a checkpoint directory each entry of ``ranks`` holds that worker's ``model``,
    ``optimizer`` (keyed by parameter name, as ``get_state_dict`` gives it), ``strategy``,
    ``replica``, ``loader``, ``rng``, ``scheduler``, ``scaler`` and ``extra``, with every
    tensor whole (unsharded). A one-file checkpoint (or any framed phalanx file) is returned
    as it was written.
    """
    with _os_errors_refused(path):
        return _consistently(path, _read_directory, read_verified)


def _read_directory(ckpt: Opened) -> dict[str, Any]:
    marker = _marker(ckpt)
    ranks = [_read_rank_file(ckpt, r) for r in range(marker["world_size"])]
    tensors = _load_whole(ckpt, sorted({k for rank in ranks for k in _refs(rank["skeleton"])}))
    for r, rank in enumerate(ranks):
        parts = _join(rank.pop("skeleton"), tensors)
        own = parts.get(f"rank{r}") or {}
        rank.update(model=parts["model"], optimizer=parts.get("optim"), strategy=parts.get("strategy"),
                    replica=own.get("replica"), buffers=own.get("buffers"))
    return {"format": DCP_FORMAT, "world_size": marker["world_size"], "step": marker["step"],
            "extra": ranks[0]["extra"], "ranks": ranks}


def export(checkpoint: str | os.PathLike, out: str | os.PathLike) -> dict[str, torch.Tensor]:
    """Write the plain model ``state_dict`` of ``checkpoint`` (rank 0's, unsharded) to ``out``; returns it.

    The file is what :func:`~phalanx.checkpoint.save` writes: it loads into the unwrapped model with
    ``Net().load_state_dict(torch.load(out, weights_only=True))``. ``phalanx export CKPT OUT``.
    """
    def directory(ckpt: Opened) -> dict[str, torch.Tensor]:
        _marker(ckpt)
        skeleton = _read_rank_file(ckpt, 0)["skeleton"]["model"]
        return _join(skeleton, _load_whole(ckpt, _refs(skeleton)))

    with _os_errors_refused(checkpoint):
        state = _consistently(checkpoint, directory, _model_state)  # every byte checked before the file is written
    atomic_write(out, to_bytes(dict(state)))
    return state


def checkpoint_step(path: str | os.PathLike) -> int | None:
    """The step of the complete checkpoint directory at ``path`` (its marker only is read); None if there is none.

    Example:
        >>> checkpoint_step("/nonexistent/ckpt") is None
        True
    """
    found = _resolve(os.fspath(path))
    if not os.path.isdir(found) or not os.path.exists(os.path.join(found, MARKER)):
        return None
    return int(_read_marker(found)["step"])
