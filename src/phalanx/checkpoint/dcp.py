"""A checkpoint directory's contents on torch.distributed.checkpoint (DCP): what is written and how it is read back.

The directory holds DCP's files (``.metadata``, ``__<rank>_0.distcp``) with every tensor
(model, optimizer, the strategy's shared state, each worker's own strategy state and
buffers), one small verified file per worker (``rank-<r>.pt``: the skeleton of its state
with each tensor replaced by a reference to its DCP key, plus data position, RNG, step,
scheduler, scaler, ``extra``) and the marker (``phalanx.json``), written last, which lists
every file's size and SHA-256 (the data files' per stored chunk). A read goes through
:class:`phalanx.sealed.Opened`: one open directory, its regular files only, every byte
checked before it is used, and DCP's metadata checked to tile each tensor with its chunks.

Reading runs no code from the files: the per-worker files load with ``weights_only=True``
and DCP's metadata is read by :mod:`phalanx.checkpoint.dcp_reader`'s unpickler, which builds only DCP's own
metadata classes. How the workers agree and how the directory comes into place is
:mod:`phalanx.checkpoint.agreement` and :mod:`phalanx.checkpoint.handle`.

Example:
    >>> tensors = {}
    >>> skeleton = _split({"w": torch.ones(2), "n": 3}, "model", tensors)
    >>> skeleton, sorted(tensors), _join(skeleton, tensors)["w"].tolist()
    ({'w': ('<dcp>', 'model/w'), 'n': 3}, ['model/w'], [1.0, 1.0])
"""
from __future__ import annotations

import contextlib
import os
import warnings
from typing import Any, Iterator

import torch
from torch import nn

from ..group import group
from ..errors import CheckpointError, ConfigError, usage
from ..framing import MARKER, unframe
from ..sealed import Opened, digest_files, write_marker
from ..strategies.base import state_with_step
from .dcp_reader import _MetadataUnpickler, _dcp, _safe_reader
from .training_state import TrainingState, check_fit, cpu_copy, replica_state, resize_warning, rng_state
from ..wrap import unwrap


DCP_FORMAT = "phalanx-dcp-1"
# the attribute a data chunk's storage entry in .metadata carries its SHA-256 in, taken as it was written (.hashing)
DIGEST = "phalanx_sha256"


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """Without DCP's warning that a process-local save or load is process-local: that is what we asked for."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


# -- writing --------------------------------------------------------------------------------------------------------

def _snapshot(state: TrainingState, me: int) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Split this worker's state into DCP's flat tensors and the small per-worker file (skeleton and the rest)."""
    model = unwrap(state.model)
    msd, osd = _live_state(model, state.optimizer)
    params = {name for name, _ in model.named_parameters()}
    # A worker's own buffers (BatchNorm statistics differ per worker): kept per worker, restored on the same size.
    buffers = {k: v for k, v in msd.items() if k not in params and isinstance(v, torch.Tensor)
               and type(v) is torch.Tensor}
    strategy = state.strategy
    parts = {"model": msd, "optim": osd,
             "strategy": state_with_step(strategy) if strategy is not None else None,
             f"rank{me}": {"replica": (replica_state(strategy) or None) if strategy is not None else None,
                           "buffers": buffers}}
    tensors: dict[str, torch.Tensor] = {}
    skeleton = _split(parts, "", tensors)
    rank_file = {"format": DCP_FORMAT, "rank": me, "world_size": group.world_size(), "step": state.step,
                 "skeleton": skeleton,
                 "loader": cpu_copy(state.loader.state_dict()) if state.loader is not None else None,
                 "scheduler": cpu_copy(state.scheduler.state_dict()) if state.scheduler is not None else None,
                 "scaler": cpu_copy(state.scaler.state_dict()) if state.scaler is not None else None,
                 "rng": rng_state(), "extra": cpu_copy(state.extra),
                 "optimizer_class": type(state.optimizer).__name__ if state.optimizer is not None else None}
    return tensors, rank_file


def _live_state(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> tuple[dict[str, Any], Any]:
    """torch's ``get_state_dict``: parameter names as keys, plain or sharded (DTensor) values; no copies."""
    with _grads_present(optimizer):  # keeps DCP from stepping the optimizer (and phalanx's hooks) to init it
        if optimizer is None:
            return _dcp().state_dict.get_model_state_dict(model), None
        try:
            return _dcp().state_dict.get_state_dict(model, optimizer)
        except KeyError as err:
            raise ConfigError(usage("an optimizer holding parameters that are not the model's",
                                    "the optimizer built from this model's parameters",
                                    "Pass the model and optimizer px.wrap returned together.")) from err


TENSOR = "<dcp>"  # a skeleton leaf ("<dcp>", key): the tensor stored under DCP's ``key``


def _split(obj: Any, prefix: str, tensors: dict[str, torch.Tensor]) -> Any:
    """``obj`` with every tensor moved into ``tensors`` under its path ("a/b/0/c") and replaced by a reference."""
    if isinstance(obj, torch.Tensor):
        tensors[prefix] = obj.detach()
        return (TENSOR, prefix)
    if isinstance(obj, dict):
        return type(obj)((k, _split(v, f"{prefix}/{k}" if prefix else str(k), tensors)) for k, v in obj.items())
    if isinstance(obj, (list, tuple)):
        return type(obj)(_split(v, f"{prefix}/{i}", tensors) for i, v in enumerate(obj))
    return obj


def _join(skeleton: Any, tensors: dict[str, torch.Tensor]) -> Any:
    """The inverse of :func:`_split`."""
    if _is_ref(skeleton):
        return tensors[skeleton[1]]
    if isinstance(skeleton, dict):
        return type(skeleton)((k, _join(v, tensors)) for k, v in skeleton.items())
    if isinstance(skeleton, (list, tuple)):
        return type(skeleton)(_join(v, tensors) for v in skeleton)
    return skeleton


def _is_ref(x: Any) -> bool:
    return type(x) is tuple and len(x) == 2 and x[0] == TENSOR and isinstance(x[1], str)


def _refs(skeleton: Any) -> list[str]:
    if _is_ref(skeleton):
        return [skeleton[1]]
    values = skeleton.values() if isinstance(skeleton, dict) else skeleton if isinstance(skeleton, (list, tuple)) \
        else ()
    return [k for v in values for k in _refs(v)]


@contextlib.contextmanager
def _grads_present(optimizer: torch.optim.Optimizer | None) -> Iterator[None]:
    """Give parameters without a gradient a zero one for the duration.

    torch's ``get_state_dict``/``set_state_dict`` initialise an optimizer whose state is empty by
    calling ``optimizer.step()``, which would run the strategy's exchange and count a step; they skip
    that when gradients exist. Ours are removed again afterwards.
    """
    given = []
    if optimizer is not None and not optimizer.state:
        for group_ in optimizer.param_groups:
            for p in group_["params"]:
                if p.requires_grad and p.grad is None:
                    p.grad = torch.zeros_like(p)
                    given.append(p)
    try:
        yield
    finally:
        for p in given:
            p.grad = None


def _seal(tmp: str, path: str, world: int, step: int) -> None:
    """Check the temporary directory holds every worker's part, then write the marker (last: it says "complete").

    The marker lists every file with its size and SHA-256 (DCP's data files per stored chunk, as
    ``.metadata`` places them): a reader uses no byte it does not vouch for (:class:`phalanx.sealed.Opened`).
    """
    names = [".metadata", *(f"rank-{r}.pt" for r in range(world))]
    lacking = [name for name in names if not os.path.exists(os.path.join(tmp, name))]
    if lacking:
        raise CheckpointError(f"the checkpoint written to {tmp!r} lacks {', '.join(lacking)}; expected every "
                              f"worker's part. {path!r} is left as it was: save again.")
    with open(os.path.join(tmp, ".metadata"), "rb") as f:
        storage = _MetadataUnpickler(f).load().storage_data
    chunks: dict[str, list[tuple[int, int]] | None] = {name: None for name in names}
    known: dict[tuple[str, int, int], str] = {}  # hashed as written (.hashing): not read back
    for info in storage.values():
        chunks.setdefault(info.relative_path, []).append((info.offset, info.length))
        digest = getattr(info, DIGEST, None)
        if isinstance(digest, str) and len(digest) == 64:
            known[(info.relative_path, info.offset, info.length)] = digest
    write_marker(tmp, {"format": DCP_FORMAT, "world_size": world, "step": step}, digest_files(tmp, chunks, known))


# -- reading --------------------------------------------------------------------------------------------------------

def _read_marker(path: str) -> dict[str, Any]:
    """The marker of the complete checkpoint directory ``path`` (format, world size, step, files), checked."""
    with Opened(path) as ckpt:
        return _marker(ckpt)


def _marker(ckpt: Opened) -> dict[str, Any]:
    """The opened checkpoint's marker, with the format, world size and step px.save_checkpoint writes."""
    marker = ckpt.marker
    ok = marker.get("format") == DCP_FORMAT and all(type(marker.get(k)) is int for k in ("world_size", "step")) \
        and marker["world_size"] >= 1
    if not ok:
        raise CheckpointError(f"{ckpt.path!r} has a {MARKER} that is not phalanx's ({str(marker)[:120]}); expected "
                              f"format {DCP_FORMAT!r} with a world size and step. Resume from a checkpoint "
                              "px.save_checkpoint wrote, unedited.")
    return marker


def _read_rank_file(ckpt: Opened, rank: int) -> dict[str, Any]:
    """Worker ``rank``'s own file of the opened checkpoint: its skeleton and non-tensor state."""
    name = f"rank-{rank}.pt"
    body = unframe(ckpt.read(name), ckpt.where(name))
    if body.get("format") != DCP_FORMAT or body.get("rank") != rank or not isinstance(body.get("skeleton"), dict) \
            or "model" not in body["skeleton"]:
        raise CheckpointError(f"{ckpt.path!r}: rank-{rank}.pt has the framing of a phalanx checkpoint but not its "
                              "structure; expected a worker's file from px.save_checkpoint. Resume from a "
                              "checkpoint px.save_checkpoint wrote, unedited.")
    return body


def _load_directory(ckpt: Opened, state: TrainingState, *, restore_rng: bool) -> dict[str, Any]:
    """Restore ``state`` from the opened directory: this worker's own part, or rank 0's on another world size.

    Every byte is read and checked before the first thing is changed (:class:`phalanx.sealed.Opened`).
    """
    path = ckpt.path
    marker = _marker(ckpt)
    me, world = group.rank(), group.world_size()
    same = marker["world_size"] == world
    own = _read_rank_file(ckpt, me if same else 0)
    skeleton = own["skeleton"]
    metadata = _safe_reader(ckpt).read_metadata()
    model = unwrap(state.model)
    optimizer = state.optimizer if skeleton.get("optim") is not None else None
    msd, osd = _live_state(model, optimizer)
    _check_same_model(path, skeleton["model"], msd, metadata)
    check_fit(path, optimizer, skeleton.get("optim"), osd, own.get("rng") if same and restore_rng else None,
              own.get("optimizer_class"))
    wanted = {"model": skeleton["model"], "optim": skeleton.get("optim") if optimizer is not None else None,
              "strategy": skeleton.get("strategy") if state.strategy is not None else None,
              "own": skeleton.get(f"rank{me}") if same else None}
    keys = _refs(wanted)
    lacking = [k for k in keys if k not in metadata.state_dict_metadata]
    if lacking:
        raise CheckpointError(f"{path!r} is damaged: its DCP metadata lacks {', '.join(lacking[:5])}; expected "
                              "every tensor its workers' files name. Resume from an earlier checkpoint.")
    live: dict[str, torch.Tensor] = {}
    _split({"model": msd, "optim": osd}, "", live)
    _check_chunks(path, metadata, keys)
    targets = {k: _target(k, metadata.state_dict_metadata[k], live, msd) for k in keys}
    if targets:
        _dcp_load(ckpt, targets)
    parts = _join(wanted, targets)
    sd = _dcp().state_dict
    try:
        with _grads_present(optimizer):
            sd.set_model_state_dict(model, parts["model"], options=sd.StateDictOptions(strict=True))
            if optimizer is not None:
                # Not strict: a parameter the optimizer kept no state for (no gradient yet, momentum 0) gets none,
                # as it was saved; the param groups were matched above (check_fit).
                sd.set_optimizer_state_dict(model, optimizer, parts["optim"],
                                            options=sd.StateDictOptions(strict=False))
        if parts["own"] and parts["own"].get("buffers"):
            model.load_state_dict(parts["own"]["buffers"], strict=False)
    except (RuntimeError, ValueError, KeyError) as err:
        raise CheckpointError(f"{path!r} does not fit this model or optimizer: {str(err).splitlines()[0][:300]}. "
                              "Build the same architecture (and optimizer) before loading; it holds weights "
                              "for another model otherwise.") from err
    if not same:
        resize_warning(marker["world_size"], world, f"the checkpoint {path!r}")
    snapshot = {"model": None, "optimizer": None, "strategy": parts["strategy"],
                "replica": (parts["own"] or {}).get("replica"), "loader": own.get("loader"),
                "scheduler": own.get("scheduler"), "scaler": own.get("scaler"), "step": own["step"],
                "extra": own.get("extra"), "rng": own.get("rng") if same and restore_rng else None}
    try:
        state.restore(snapshot)
    except (RuntimeError, ValueError, KeyError) as err:
        raise CheckpointError(f"{path!r} does not fit this run's strategy, loader or scheduler: "
                              f"{str(err).splitlines()[0][:300]}. Resume with the setup that saved it.") from err
    return {"world_size": marker["world_size"], "step": own["step"], "extra": own.get("extra")}


def _target(key: str, meta: Any, live: dict[str, torch.Tensor], msd: dict[str, Any]) -> torch.Tensor:
    """A tensor for DCP to load ``key`` into, laid out as this run holds it (a sharded parameter stays sharded)."""
    size, dtype = tuple(meta.size), meta.properties.dtype
    like = live.get(key)
    if like is None and key.startswith("optim/state/"):  # a fresh optimizer: its state is laid out as its parameter
        like = msd.get(key.split("/")[2])
    if isinstance(like, torch.Tensor) and tuple(like.shape) == size:
        return torch.empty_like(like, dtype=dtype)
    return torch.empty(size, dtype=dtype)


def _check_same_model(path: str, saved: dict[str, Any], live: dict[str, Any], metadata: Any) -> None:
    """One error naming the keys and shapes that differ between the checkpoint's model and this one."""
    missing = sorted(set(live) - set(saved))
    unexpected = sorted(set(saved) - set(live))
    shapes = []
    for k in sorted(set(saved) & set(live)):
        meta = metadata.state_dict_metadata.get(saved[k][1]) if _is_ref(saved[k]) else None
        if meta is not None and isinstance(live[k], torch.Tensor) and tuple(meta.size) != tuple(live[k].shape):
            shapes.append(f"{k} {tuple(meta.size)} vs {tuple(live[k].shape)}")
    if missing or unexpected or shapes:
        said = "; ".join(part for part in (
            f"this model has {_few(missing)} which it lacks" if missing else "",
            f"it has {_few(unexpected)} which this model lacks" if unexpected else "",
            f"shapes differ: {_few(shapes)}" if shapes else "") if part)
        raise CheckpointError(f"{path!r} holds another model: {said}. Build the same architecture before "
                              "loading; nothing was changed.")


def _few(items: list[str], n: int = 5) -> str:
    return ", ".join(items[:n]) + (f" and {len(items) - n} more" if len(items) > n else "")


def _load_whole(ckpt: Opened, keys: list[str]) -> dict[str, torch.Tensor]:
    """The tensors ``keys`` of an opened checkpoint directory, whole (unsharded), in this process alone."""
    path = ckpt.path
    metadata = _safe_reader(ckpt).read_metadata()
    lacking = [k for k in keys if k not in metadata.state_dict_metadata]
    if lacking:
        raise CheckpointError(f"{path!r} is damaged: its DCP metadata lacks {', '.join(lacking[:5])}; expected "
                              "every tensor its workers' files name. Resume from an earlier checkpoint.")
    _check_chunks(path, metadata, keys)
    entries = metadata.state_dict_metadata
    tensors = {k: torch.empty(tuple(entries[k].size), dtype=entries[k].properties.dtype) for k in keys}
    if tensors:
        _dcp_load(ckpt, tensors)
    return tensors


def _check_chunks(path: str, metadata: Any, keys: list[str]) -> None:
    """Refuse metadata whose stored chunks do not tile each tensor exactly (a part never read would be memory
    left uninitialised), or that places a chunk nowhere in the files."""
    for key in keys:
        meta = metadata.state_dict_metadata[key]
        size = tuple(meta.size)
        boxes = []
        problem = None
        for chunk in meta.chunks:
            offsets, sizes = tuple(chunk.offsets), tuple(chunk.sizes)
            if len(offsets) != len(size) or len(sizes) != len(size) or any(
                    o < 0 or n < 0 or o + n > s for o, n, s in zip(offsets, sizes, size)):
                problem = f"a chunk at {list(offsets)} of {list(sizes)} lies outside its size {list(size)}"
            elif _dcp().metadata.MetadataIndex(key, chunk.offsets) not in metadata.storage_data:
                problem = f"the chunk at {list(offsets)} is stored nowhere"
            boxes.append((offsets, sizes))
        if problem is None:
            covered = sum(_volume(sizes) for _, sizes in boxes)
            overlap = any(all(a < c + m and c < a + n for a, n, c, m in zip(o1, s1, o2, s2))
                          for i, (o1, s1) in enumerate(boxes) for o2, s2 in boxes[i + 1:]
                          if _volume(s1) and _volume(s2))
            if overlap or covered != _volume(size):
                problem = f"its {len(boxes)} stored chunk(s) cover {covered:,} of its {_volume(size):,} elements" \
                    + (" and overlap" if overlap else "")
        if problem is not None:
            raise CheckpointError(f"{path!r}: DCP's metadata for {key!r} is inconsistent ({problem}); expected "
                                  "chunks that tile each tensor once. Refusing it: resume from an earlier "
                                  "checkpoint.")


def _volume(sizes: tuple[int, ...]) -> int:
    n = 1
    for s in sizes:
        n *= s
    return n


def _dcp_load(ckpt: Opened, targets: dict[str, torch.Tensor]) -> None:
    """DCP's load into ``targets``, in this process alone; a damaged data file is one CheckpointError."""
    try:
        with _quiet():
            _dcp().load(targets, storage_reader=_safe_reader(ckpt), no_dist=True)
    except CheckpointError:
        raise
    except (Exception, _dcp().api.CheckpointException) as err:  # noqa: BLE001 - a damaged file
        inner = next(iter((getattr(err, "failures", None) or {}).values()), None)
        inner = inner[0] if isinstance(inner, tuple) else inner
        if isinstance(inner, CheckpointError):  # ours, raised in read_data and wrapped by DCP: it names the file
            raise type(inner)(*inner.args) from None
        first = next(iter(str(err).strip().splitlines()), type(err).__name__)
        raise CheckpointError(f"{ckpt.path!r} could not be read: its DCP data is truncated or corrupted "
                              f"({type(err).__name__}: {first[:200]}); expected an intact checkpoint. Resume from "
                              "an earlier checkpoint.") from None
