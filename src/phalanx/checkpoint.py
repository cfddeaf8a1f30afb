"""Checkpoints that are written atomically and verified on load.

Two kinds:

* ``px.save(model, path)``: the plain ``state_dict`` of the user's module (no
  ``module.`` prefixes), a normal ``torch.save`` file that ``Net().load_state_dict``
  takes as it is. Main worker only; call it anywhere, e.g. under ``if px.is_main():``.
* ``px.save_checkpoint(path, model, optimizer, ...)``: everything a run needs to
  continue exactly, for every worker: each worker's :class:`phalanx.state.TrainingState`
  snapshot (model, optimizer, the strategy's shared state and this worker's own
  part of it such as compressor residuals, the data position, its Python, NumPy,
  torch and CUDA RNG, the step, an LR scheduler and GradScaler when given).
  **Collective**: call it on every worker (rank 0 writes). Called on some workers
  only (say under ``if rank == 0:``, where ``torch.save`` was), it fails within
  :data:`ENTRY_WAIT_S` seconds with a message that says so, instead of hanging.

The file carries a SHA-256 of its body and is loaded with ``weights_only=True``,
so a truncated or tampered file is refused and nothing in it can run code.

Example:
    >>> import torch, phalanx as px, tempfile, os
    >>> net = torch.nn.Linear(2, 2)
    >>> path = os.path.join(tempfile.mkdtemp(), "model.pt")
    >>> px.save(net, path); net.load_state_dict(torch.load(path, weights_only=True))
    <All keys matched successfully>
"""
from __future__ import annotations

import os
import time
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from . import group
from .errors import CheckpointError, ConfigError, usage
from .framing import MAGIC, atomic_write, check_plain, read_verified, to_bytes, write_verified
from .state import TrainingState, gather_to_main, resize_warning, rng_state, set_rng_state, shared
from .sharding import is_sharded
from .wrap import unwrap

FORMAT = "phalanx-checkpoint-2"
#: Seconds the first worker to enter ``save_checkpoint`` waits for the others before saying it is not collective.
#: Synchronous strategies bring workers there within moments of each other; under local strategies (LocalSGD,
#: DiLoCo) a slow worker can trail by up to one round of local steps: raise this if yours trail by more.
ENTRY_WAIT_S = 10.0
SAME_AS_RANK0 = "=rank0"  # a part of a worker's snapshot that equals rank 0's is stored once

# Kept importable from here: the parameter-server shard store and older code use these names.
read_checkpoint = read_verified
__all__ = ["MAGIC", "load_checkpoint", "load_state", "read_checkpoint", "rng_state", "save", "save_checkpoint",
           "save_state", "set_rng_state", "write_verified", "check_plain", "atomic_write"]


LAST_SAVED_KEY = "checkpoint/last"  # in the group's store: the newest px.save_checkpoint file (absolute path)


def save(model: nn.Module, path: str | os.PathLike) -> None:
    """Save the plain model's weights from the main worker only (others return at once).

    Not collective: call it on every worker or under ``if px.is_main():``, as you like; except for a
    model sharded by ``px.wrap(..., shard=...)``, whose weights are gathered: call it on every worker.

    Example:
        >>> import torch, phalanx as px, tempfile, os
        >>> px.save(torch.nn.Linear(1, 1), os.path.join(tempfile.mkdtemp(), "m.pt"))
    """
    if is_sharded(model):  # collective: the whole weights, on rank 0's CPU only, no DTensors
        state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    elif group.is_main():
        state = {k: v.detach().cpu() for k, v in unwrap(model).state_dict().items()}
    if group.is_main():
        atomic_write(path, to_bytes(state))


def save_checkpoint(path: str | os.PathLike, model: nn.Module, optimizer: torch.optim.Optimizer | None = None, *,
                    loader: Any = None, step: int = 0, extra: dict[str, Any] | None = None,
                    scheduler: Any = None, scaler: Any = None) -> None:
    """Write a resumable checkpoint of every worker's state. Collective: call it on every worker; rank 0 writes.

    Every worker returns once the file is written, or raises rank 0's error (a full
    disk names the path). Called on some workers only, it raises within
    :data:`ENTRY_WAIT_S` seconds saying so.

    It holds each worker's :class:`~phalanx.state.TrainingState` snapshot: model,
    optimizer, the strategy's shared and per-worker state, the loader's position,
    every worker's RNG (Python, NumPy, torch, CUDA), ``step``, and ``scheduler`` /
    ``scaler`` state when given. ``extra`` holds the caller's own plain values.

    Example:
        >>> import torch, phalanx as px, tempfile, os
        >>> net = torch.nn.Linear(2, 1); opt = torch.optim.SGD(net.parameters(), lr=0.1)
        >>> p = os.path.join(tempfile.mkdtemp(), "ckpt.pt")
        >>> px.save_checkpoint(p, net, opt, step=3); px.load_checkpoint(p, net, opt)["step"]
        3
    """
    check_plain(extra or {}, "extra")  # refuse before any collective, on every worker alike
    save_state(path, TrainingState(model, optimizer, loader=loader, scheduler=scheduler, scaler=scaler,
                                   extra=extra, step=step))


def save_state(path: str | os.PathLike, state: TrainingState) -> None:
    """Gather every worker's ``state.capture()`` to rank 0 and write them in one verified file. Collective.

    Every worker returns once the file is written, or raises the same error as rank 0
    when writing failed (a full disk), so no worker runs on believing it was saved.
    """
    key = _all_enter("save_checkpoint")
    state.settle()  # a step this worker skipped is closed (its exchange runs on every worker) before capture
    snapshots = gather_to_main(state.capture())
    if snapshots is None:
        _wait_for_write(key)
        return
    for snap in snapshots[1:]:
        for part, value in snap.items():
            if part not in ("format", "rank") and _equal(value, snapshots[0][part]):
                snap[part] = SAME_AS_RANK0  # identical replicas (synchronous strategies) are stored once
    try:
        write_verified(path, {"format": FORMAT, "world_size": len(snapshots), "step": state.step,
                              "extra": state.extra, "ranks": snapshots})
    except Exception as err:
        _post_write(key, f"{type(err).__name__}\n{err}")
        raise
    _post_write(key, "ok")
    _post_saved(path)


def _post_saved(path: str | os.PathLike) -> None:
    """Leave the newest checkpoint's path in the group's store: a launcher whose job ends names it."""
    store = group.store()
    if store is not None:
        try:
            store.set(LAST_SAVED_KEY, os.path.abspath(os.fspath(path)))
        except Exception:  # noqa: BLE001 - only a hint for the launcher's last line; the file is written
            pass


def load_checkpoint(path: str | os.PathLike, model: nn.Module, optimizer: torch.optim.Optimizer | None = None, *,
                    loader: Any = None, restore_rng: bool = True, scheduler: Any = None,
                    scaler: Any = None) -> dict[str, Any]:
    """Restore what :func:`save_checkpoint` wrote; returns ``{"step", "extra", "world_size"}``.

    Each worker takes its own snapshot. Under another number of workers each takes
    rank 0's model, optimizer, strategy state and data position (the rest of the
    epoch is re-split over the workers there are now) and a warning says what does
    not carry over. Every worker reads the file, so it must be on a filesystem they
    share. Not collective.
    """
    state = TrainingState(model, optimizer, loader=loader, scheduler=scheduler, scaler=scaler)
    body = load_state(path, state, restore_rng=restore_rng)
    return {"step": state.step, "extra": state.extra, "world_size": body["world_size"]}


def load_state(path: str | os.PathLike, state: TrainingState, *, restore_rng: bool = True) -> dict[str, Any]:
    """Restore ``state`` from a checkpoint file (this worker's snapshot, or rank 0's shared part); returns the body."""
    body = read_verified(path)
    path = os.fspath(path)
    if body.get("format") == "phalanx-ps-shards-1":
        raise CheckpointError(f"{path!r} is a parameter-server shard file; expected a file from "
                              "px.save_checkpoint. Give shard files to the servers (--checkpoint PATH), "
                              "not to px.load_checkpoint.")
    if body.get("format") != FORMAT:
        raise CheckpointError(f"{path!r} is a phalanx file of format {body.get('format', 'phalanx-checkpoint-1')!r}; "
                              f"expected {FORMAT!r} (from px.save_checkpoint of this version). Resume from a "
                              "checkpoint written by this version, or start afresh.")
    _check_structure(body, path)
    ranks, me, world = body["ranks"], group.rank(), group.world_size()
    if len(ranks) == world:
        snapshot = {k: (ranks[0][k] if isinstance(v, str) and v == SAME_AS_RANK0 else v)
                    for k, v in ranks[me].items()}
    else:
        resize_warning(len(ranks), world, f"the checkpoint {path!r}")
        snapshot = shared(ranks[0])
    if not restore_rng:
        snapshot = {k: v for k, v in snapshot.items() if k != "rng"}
    try:
        state.restore(snapshot)
    except (RuntimeError, ValueError, KeyError) as err:
        raise CheckpointError(f"{path!r} does not fit this model or optimizer: {str(err).splitlines()[0][:300]}. "
                              "Build the same architecture (and optimizer) before loading; it holds weights "
                              "for another model otherwise.") from err
    return body


def _check_structure(body: dict[str, Any], path: str) -> None:
    """Refuse a checkpoint whose framing and hash are valid but whose body is not what save_state writes
    (edited by hand, or by another program), with one line, before anything is restored or warned about."""
    ranks = body.get("ranks")
    problem = None
    if not isinstance(ranks, list) or not ranks:
        problem = f"'ranks' is {type(ranks).__name__ if not isinstance(ranks, list) else 'an empty list'}, " \
                  "not a list of one snapshot per worker"
    elif not all(isinstance(r, dict) for r in ranks):
        problem = "a worker's snapshot is not a dict"
    elif body.get("world_size") != len(ranks) or isinstance(body.get("world_size"), bool):
        problem = f"'world_size' is {body.get('world_size')!r} but {len(ranks)} snapshots are stored"
    elif isinstance(body.get("step"), bool) or not isinstance(body.get("step"), int):
        problem = f"'step' is {body.get('step')!r}, not an integer"
    elif any(v == SAME_AS_RANK0 for v in ranks[0].values() if isinstance(v, str)):
        problem = "rank 0's snapshot refers to itself"
    else:
        lacking = sorted({k for r in ranks[1:] for k, v in r.items()
                          if isinstance(v, str) and v == SAME_AS_RANK0 and k not in ranks[0]})
        if lacking:
            problem = f"a worker's part {lacking[0]!r} refers to rank 0's, which rank 0 lacks"
    if problem:
        raise CheckpointError(f"{path!r} has the framing of a phalanx checkpoint but not its structure: {problem}. "
                              "Resume from a checkpoint px.save_checkpoint wrote, unedited.")


# -- the collective entry check ------------------------------------------------------------------------------------


def _post_write(key: str | None, outcome: str) -> None:
    store = group.store()
    if key is not None and store is not None:
        store.set(f"{key}/written", outcome)


def _wait_for_write(key: str | None) -> None:
    """Wait for rank 0's write; raise its error here too."""
    store = group.store()
    if key is None or store is None:
        return
    from .comm import guarded
    with guarded("waiting for rank 0 to write the checkpoint"):
        store.wait([f"{key}/written"])
    outcome = store.get(f"{key}/written").decode()
    if outcome != "ok":
        kind, _, message = outcome.partition("\n")
        raise (ConfigError if kind == "ConfigError" else CheckpointError)(
            f"rank 0 could not write the checkpoint: {message}")


def _all_enter(what: str) -> str | None:
    """Every worker announces entry on the group's store; fail fast if some never come.

    ``save_checkpoint`` gathers every worker's state, so a call on rank 0 alone (the
    place ``torch.save`` had in a DDP script) would wait in the gather until the
    collective timeout and then look like a crash. Instead the workers meet on the
    store first: one that waited :data:`ENTRY_WAIT_S` seconds for the others raises a
    ConfigError saying the call is collective, and posts it, so a worker arriving
    later raises the same at once.
    """
    store, world, me = group.store(), group.world_size(), group.rank()
    if store is None or world == 1:
        return None
    # This rank's call count, kept in the store: a regrouped job (elastic: a new store prefix) counts afresh.
    key = f"phalanx-entry/{what}/{store.add(f'phalanx-entry/{what}/calls/{me}', 1)}"
    store.set(f"{key}/{me}", "1")
    count = store.add(f"{key}/count", 1)
    deadline = time.monotonic() + ENTRY_WAIT_S
    while count < world:
        if store.check([f"{key}/gave-up"]):
            raise ConfigError(store.get(f"{key}/gave-up").decode())
        if time.monotonic() > deadline:
            came = [r for r in range(world) if store.check([f"{key}/{r}"])]
            missing = [r for r in range(world) if r not in came]
            # Short, cause first: a peer stuck in its next collective quotes this line from our exit note.
            message = usage(f"px.{what} is collective but rank(s) {_ranks(missing)} did not call it within "
                            f"{ENTRY_WAIT_S:g} s of rank(s) {_ranks(came)}", "a call on every worker",
                            "Call it on every worker, not under `if rank == 0:` "
                            "(px.save is the main-worker-only save).")
            store.set(f"{key}/gave-up", message)
            raise ConfigError(message)
        time.sleep(0.02)
        count = store.add(f"{key}/count", 0)
    return key


def _ranks(ranks: list[int]) -> str:
    return ", ".join(map(str, ranks))


def _equal(a: Any, b: Any) -> bool:
    """Exact equality of nested tensors and plain values."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype \
            and a.shape == b.shape and bool(torch.equal(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b, strict=True))
    return type(a) is type(b) and a == b
