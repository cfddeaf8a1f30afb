"""Checkpoints: sharded, asynchronous and reshardable (torch.distributed.checkpoint), atomic and verified.

Two kinds:

* ``px.save(model, path)``: the plain ``state_dict`` of the user's module (no
  ``module.`` prefixes), a normal ``torch.save`` file that ``Net().load_state_dict``
  takes as it is. Main worker only; call it anywhere, e.g. under ``if px.is_main():``.
* ``px.save_checkpoint(path, model, optimizer, ...)``: everything a run needs to
  continue exactly, written as a **directory** by torch's distributed checkpoint (DCP):
  every worker writes its own part (a sharded model's shards, its share of the
  replicated tensors), nothing is gathered to one worker. **Collective**: call it on
  every worker. Called on some workers only (say under ``if rank == 0:``, where
  ``torch.save`` was), it fails within :data:`ENTRY_WAIT_S` seconds with a message that
  says so, instead of hanging. ``blocking=False`` returns a :class:`SaveHandle` at once
  and writes from a staged copy while training goes on.

A checkpoint directory holds DCP's files (``.metadata``, ``__<rank>_0.distcp``) with
every tensor (model, optimizer, the strategy's shared state, each worker's own strategy
state and buffers), one small verified file per worker (``rank-<r>.pt``: the non-tensor
skeleton, data position, RNG, step, scheduler, scaler, ``extra``) and ``phalanx.json``,
written last. It is written into ``<path>.tmp-<id>`` and renamed into place only when
every worker finished, so a save killed half-way never replaces the last good one.

It loads on any number of workers (DCP reshards), and loading runs no code from the
files: the per-worker files load with ``weights_only=True`` and DCP's metadata is read by
an unpickler that builds only DCP's own metadata classes. ``phalanx export CKPT model.pt``
turns one into a plain ``state_dict``. One-file checkpoints of earlier versions still load.

Example:
    >>> import torch, phalanx as px, tempfile, os
    >>> net = torch.nn.Linear(2, 2)
    >>> path = os.path.join(tempfile.mkdtemp(), "model.pt")
    >>> px.save(net, path); net.load_state_dict(torch.load(path, weights_only=True))
    <All keys matched successfully>
"""
from __future__ import annotations

import contextlib
import errno
import functools
import json
import os
import pickle
import shutil
import socket
import time
import uuid
import warnings
from concurrent.futures import Future
from typing import Any, Iterator

import torch
import torch.distributed as dist
from torch import nn

from . import group
from .comm import guarded
from .errors import CheckpointError, ConfigError, usage
from .spans import span
from .framing import MAGIC, MARKER, atomic_write, check_plain, read_verified, to_bytes, write_verified
from .training_state import TrainingState, cpu_copy, resize_warning, rng_state, set_rng_state, shared
from .sharding import is_sharded
from .wrap import unwrap


def _dcp() -> Any:
    """``torch.distributed.checkpoint``, imported at the first checkpoint rather than with phalanx.

    Why: it pulls DTensor and sympy, 1.3 s of every worker's start-up (``python -X importtime -c 'import phalanx'``),
    and most jobs start many more workers than they write checkpoints.
    """
    import torch.distributed.checkpoint as dcp
    import torch.distributed.checkpoint.state_dict  # noqa: F401 - reached as dcp.state_dict
    return dcp

FORMAT = "phalanx-checkpoint-2"  # the one-file format of earlier versions, still loaded
DCP_FORMAT = "phalanx-dcp-1"
#: Seconds the first worker to enter ``save_checkpoint`` waits for the others before saying it is not collective.
#: Synchronous strategies bring workers there within moments of each other; under local strategies (LocalSGD,
#: DiLoCo) a slow worker can trail by up to one round of local steps: raise this if yours trail by more.
ENTRY_WAIT_S = 10.0
SAME_AS_RANK0 = "=rank0"  # one-file format: a part of a worker's snapshot that equals rank 0's is stored once

# Kept importable from here: the parameter-server shard store and older code use these names.
__all__ = ["MAGIC", "SaveHandle", "export", "load_checkpoint", "load_state", "read_checkpoint", "rng_state",
           "save", "save_checkpoint", "set_rng_state", "write_verified", "check_plain", "atomic_write"]


LAST_SAVED_KEY = "checkpoint/last"  # in the group's store: the newest px.save_checkpoint checkpoint (absolute path)


def save(model: nn.Module, path: str | os.PathLike) -> None:
    """Save the plain model's weights from the main worker only (others return at once).

    Not collective: call it on every worker or under ``if px.is_main():``, as you like; except for a
    model sharded by ``px.wrap(..., shard=...)``, whose weights are gathered: call it on every worker.

    Example:
        >>> import torch, phalanx as px, tempfile, os
        >>> px.save(torch.nn.Linear(1, 1), os.path.join(tempfile.mkdtemp(), "m.pt"))
    """
    if is_sharded(model):  # collective: the whole weights, on rank 0's CPU only, no DTensors
        sd = _dcp().state_dict
        state = sd.get_model_state_dict(model, options=sd.StateDictOptions(full_state_dict=True, cpu_offload=True))
    elif group.is_main():
        state = {k: v.detach().cpu() for k, v in unwrap(model).state_dict().items()}
    if group.is_main():
        atomic_write(path, to_bytes(state))


# -- saving ---------------------------------------------------------------------------------------------------------

class SaveHandle:
    """A checkpoint being written in the background (``px.save_checkpoint(..., blocking=False)``).

    ``done()`` says whether it is written (and renamed into place); ``wait()`` blocks until
    then and raises its error, if any. The next ``px.save_checkpoint`` and ``px.shutdown()``
    wait for it themselves.
    """

    def __init__(self, path: str, future: Future | None, key: str | None, rank: int,
                 pg: Any = None, generation: int = 0) -> None:
        self.path, self.key, self.rank = path, key, rank
        self.pg, self.generation = pg, generation  # reused by the next save of the same group generation
        self._future = future
        self._committed: Future = Future()  # rank 0: set once the directory is in place (or the save failed)
        self._error: BaseException | None = None
        self._waited = False

    def done(self) -> bool:
        """True once this worker's part is written (on rank 0: and the checkpoint renamed into place)."""
        if self._future is not None and not self._future.done():
            return False
        if self.rank == 0:
            return self._committed.done()
        store = group.store() if group.is_initialized() else None
        return self.key is None or store is None or store.check([f"{self.key}/written"])

    def wait(self, timeout: float | None = None) -> None:
        """Block until the checkpoint is complete; raise a :class:`CheckpointError` if it could not be written.

        ``timeout``: at most this many seconds for this worker's write (``TimeoutError`` after), e.g. for a worker
        that is leaving because of an error and must not hang on a stalled disk.
        """
        if self._waited:
            if self._error is not None:
                raise self._error
            return
        self._waited = True
        try:
            if self._future is not None:
                try:
                    self._future.result(timeout)
                except TimeoutError:
                    raise
                except (Exception, _dcp().api.CheckpointException) as err:  # noqa: BLE001 - every rank's failure
                    if self.rank != 0:
                        raise _write_error(self.path, err) from err
            if self.rank == 0:
                self._committed.result(timeout)
            elif group.current().generation == self.generation:  # (a regrouped job has a new store: rank 0 wrote)
                _wait_for_write(self.key)
        except Exception as err:
            self._error = err
            raise

    def __repr__(self) -> str:
        return f"SaveHandle({self.path!r}, done={self.done()})"


def save_checkpoint(path: str | os.PathLike, model: nn.Module, optimizer: torch.optim.Optimizer | None = None, *,
                    loader: Any = None, step: int = 0, extra: dict[str, Any] | None = None,
                    scheduler: Any = None, scaler: Any = None, blocking: bool = True) -> SaveHandle | None:
    """Write a resumable checkpoint directory of every worker's state with DCP. Collective: call it on every worker.

    Each worker writes its own part; the directory appears at ``path`` only once every
    worker is done (a previous checkpoint there is replaced then, never before). With
    ``blocking=True`` every worker returns once it is in place, or raises (a full disk
    names the path). With ``blocking=False`` it returns a :class:`SaveHandle` as soon as
    the state is copied, and the files are written while training continues; the next save
    and ``px.shutdown()`` wait for it. Called on some workers only, it raises within
    :data:`ENTRY_WAIT_S` seconds saying so.

    It holds the model and optimizer (``get_state_dict``: plain or FSDP-sharded alike), the
    strategy's shared and per-worker state, every worker's buffers, the loader's position,
    every worker's RNG (Python, NumPy, torch, CUDA), ``step``, and ``scheduler`` /
    ``scaler`` state when given. ``extra`` holds the caller's own plain values.

    Example:
        >>> import torch, phalanx as px, tempfile, os
        >>> net = torch.nn.Linear(2, 1); opt = torch.optim.SGD(net.parameters(), lr=0.1)
        >>> p = os.path.join(tempfile.mkdtemp(), "ckpt")
        >>> px.save_checkpoint(p, net, opt, step=3); px.load_checkpoint(p, net, opt)["step"]
        3
    """
    check_plain(extra or {}, "extra")  # refuse before any collective, on every worker alike
    with span("phalanx/checkpoint"):  # the timeline (phalanx.profiling)
        handle = save_state(path, TrainingState(model, optimizer, loader=loader, scheduler=scheduler, scaler=scaler,
                                                extra=extra, step=step), blocking=blocking)
    return None if blocking else handle


def save_state(path: str | os.PathLike, state: TrainingState, *, blocking: bool = True) -> SaveHandle:
    """Write ``state`` of every worker as one DCP checkpoint directory at ``path``; see :func:`save_checkpoint`."""
    g = group.current()
    previous, g.saving = g.saving, None
    if previous is not None:
        previous.wait()  # one checkpoint in flight at a time: its error surfaces here (once), before the next starts
    path = os.path.abspath(os.fspath(path))
    key = _all_enter("save_checkpoint")
    state.settle()  # a step this worker skipped is closed (its exchange runs on every worker) before capture
    me, world = group.rank(), group.world_size()
    tmp = _agree_on_temporary(path, key)
    tensors, rank_file = _snapshot(state, me)
    try:
        os.makedirs(tmp, exist_ok=True)
        write_verified(os.path.join(tmp, f"rank-{me}.pt"), rank_file)
        failure = None
    except Exception as err:  # noqa: BLE001 - every worker must learn of it before the collective write starts
        failure = err
    _agree("rank-files", key, failure, path, tmp)
    pg = _checkpoint_group(previous, g)
    strategy = state.strategy
    # Replicated tensors are written once: spread over the workers when replicas agree, by rank 0 otherwise
    # (its model is the one every worker takes when resuming on another number of workers).
    dedup = strategy is not None and not strategy.replicas_agree(strategy.steps)
    planner = _dcp().default_planner.DefaultSavePlanner(dedup_save_to_lowest_rank=dedup)
    writer = _writer(tmp)
    distributed = dist.is_initialized() and world > 1
    kwargs = dict(storage_writer=writer, planner=planner, process_group=pg, no_dist=not distributed)
    handle = SaveHandle(path, None, key, me, pg, g.generation)
    if blocking:
        try:
            with _quiet():
                _dcp().save(tensors, **kwargs)
        except (Exception, _dcp().api.CheckpointException) as err:  # noqa: BLE001 - raised on every rank
            if me == 0:
                _abandon(tmp, key)
            raise _write_error(path, err) from err
        _finish(handle, tmp, world, state.step, blocking=True)
        g.saving = handle  # done; kept for its process group
        return handle
    handle._future = _dcp().async_save(tensors, **kwargs)  # stages (copies) now, writes in a thread
    g.saving = handle
    if me == 0:
        handle._future.add_done_callback(lambda fut: _finish(handle, tmp, world, state.step, blocking=False))
    return handle


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """Without DCP's warning that a process-local save or load is process-local: that is what we asked for."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


def _writer(tmp: str) -> Any:
    """DCP's writer for the temporary directory (a test replaces this to hold a write half-way)."""
    return _dcp().FileSystemWriter(tmp, sync_files=True)


def _finish(handle: SaveHandle, tmp: str, world: int, step: int, *, blocking: bool) -> None:
    """Rank 0, once every worker's part is written: verify, mark complete, rename into place, tell the others."""
    if handle.rank != 0:
        _wait_for_write(handle.key)
        return
    try:
        if handle._future is not None:
            try:
                handle._future.result()
            except (Exception, _dcp().api.CheckpointException) as err:  # noqa: BLE001
                raise _write_error(handle.path, err) from err
        _commit(tmp, handle.path, world, step)
    except BaseException as err:
        _abandon(tmp, handle.key, err)
        if blocking:
            raise
        handle._committed.set_exception(err)
        return
    _post_write(handle.key, "ok")
    _post_saved(handle.path)
    if not handle._committed.done():
        handle._committed.set_result(None)


def _commit(tmp: str, path: str, world: int, step: int) -> None:
    """Check the temporary directory is whole, write the marker, and swap it in for ``path``."""
    lacking = [name for name in [".metadata", *(f"rank-{r}.pt" for r in range(world))]
               if not os.path.exists(os.path.join(tmp, name))]
    if lacking:
        raise CheckpointError(f"the checkpoint written to {tmp!r} lacks {', '.join(lacking)}; expected every "
                              f"worker's part. {path!r} is left as it was: save again.")
    atomic_write(os.path.join(tmp, MARKER),
                 json.dumps({"format": DCP_FORMAT, "world_size": world, "step": step}).encode())
    old = None
    if os.path.lexists(path):
        old = f"{path}.old-{uuid.uuid4().hex[:8]}"
        os.replace(path, old)  # a kill between these two renames leaves the old one here: _resolve finds it
    os.replace(tmp, path)
    _fsync_dir(os.path.dirname(path))
    if old is not None:
        (shutil.rmtree if os.path.isdir(old) else os.unlink)(old)


def _abandon(tmp: str, key: str | None, err: BaseException | None = None) -> None:
    """Rank 0 after a failed write: remove the temporary directory and post the error for the others."""
    shutil.rmtree(tmp, ignore_errors=True)
    if err is not None:
        _post_write(key, f"{type(err).__name__}\n{err}")


def _write_error(path: str, err: BaseException) -> CheckpointError:
    """One line for a failed DCP write, naming the path, the rank and the OS error (a full disk)."""
    if isinstance(err, CheckpointError):
        return err
    failures = getattr(err, "failures", None) or {}  # DCP's CheckpointException: {rank: (exception, stack)}
    for rank, cause in sorted(failures.items()):
        cause = cause[0] if isinstance(cause, tuple) else cause
        os_error = cause
        while os_error is not None and not isinstance(os_error, OSError):
            os_error = os_error.__cause__ or os_error.__context__
        if isinstance(os_error, OSError) and os_error.errno is not None:
            return CheckpointError(_file_error(path, rank, os_error).args[0])
        first = next(iter(str(cause).strip().splitlines()), "")
        return CheckpointError(f"rank {rank} could not write the checkpoint {path!r}: {type(cause).__name__}: "
                               f"{first[:200]}. The previous checkpoint at that path is untouched (a full disk "
                               "shows this way too): free space or save elsewhere.")
    first = next(iter(str(err).strip().splitlines()), type(err).__name__)
    return CheckpointError(f"the checkpoint {path!r} could not be written: {first[:300]}. The previous "
                           "checkpoint at that path is untouched.")


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
             "strategy": strategy.state_with_step() if strategy is not None else None,
             f"rank{me}": {"replica": (strategy.replica_state_dict() or None) if strategy is not None else None,
                           "buffers": buffers}}
    tensors: dict[str, torch.Tensor] = {}
    skeleton = _split(parts, "", tensors)
    rank_file = {"format": DCP_FORMAT, "rank": me, "world_size": group.world_size(), "step": state.step,
                 "skeleton": skeleton,
                 "loader": cpu_copy(state.loader.state_dict()) if state.loader is not None else None,
                 "scheduler": cpu_copy(state.scheduler.state_dict()) if state.scheduler is not None else None,
                 "scaler": cpu_copy(state.scaler.state_dict()) if state.scaler is not None else None,
                 "rng": rng_state(), "extra": cpu_copy(state.extra)}
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


def _checkpoint_group(previous: SaveHandle | None, g: group.Group) -> Any:
    """A gloo process group for checkpoint writes only (collective to create; one per group generation).

    An asynchronous save runs DCP's collectives from a background thread while training runs its own:
    on the same process group their messages would interleave.
    """
    if not dist.is_initialized() or g.world_size == 1:
        return None
    if previous is not None and previous.pg is not None and previous.generation == g.generation:
        return previous.pg
    return dist.new_group(backend="gloo")


def _agree_on_temporary(path: str, key: str | None) -> str:
    """Rank 0 names the temporary directory (unique, with its host and pid) and removes abandoned ones."""
    store = group.store()
    if group.rank() == 0:
        _remove_abandoned(path)
        tmp = f"{path}.tmp-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        if key is not None and store is not None:
            store.set(f"{key}/tmp", tmp)
        return tmp
    with guarded("waiting for rank 0 to name the checkpoint's directory"):
        store.wait([f"{key}/tmp"])  # type: ignore[union-attr]
    return store.get(f"{key}/tmp").decode()  # type: ignore[union-attr]


def _remove_abandoned(path: str) -> None:
    """Temporary directories of ``path`` left by saves on this host whose process is gone (killed mid-write)."""
    directory, base = os.path.split(path)
    prefix = f"{base}.tmp-{socket.gethostname()}-"
    for name in os.listdir(directory) if os.path.isdir(directory) else ():
        if name.startswith(prefix):
            pid = name[len(prefix):].split("-")[0]
            if pid.isdigit() and int(pid) != os.getpid() and not _alive(int(pid)):
                shutil.rmtree(os.path.join(directory, name), ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _agree(what: str, key: str | None, failure: BaseException | None, path: str, tmp: str) -> None:
    """Every worker posts whether its step succeeded; all raise the first failure (none enters DCP's collective)."""
    store, world, me = group.store(), group.world_size(), group.rank()
    if key is None or store is None or world == 1:
        if failure is not None:
            shutil.rmtree(tmp, ignore_errors=True)
            raise _file_error(path, me, failure) from failure
        return
    mine = None if failure is None else _file_error(path, me, failure)
    store.set(f"{key}/{what}/{me}", "" if mine is None else f"{type(mine).__name__}: {mine}")
    with guarded(f"waiting for every worker's {what} of the checkpoint"):
        store.wait([f"{key}/{what}/{r}" for r in range(world)])
    for r in range(world):
        outcome = store.get(f"{key}/{what}/{r}").decode()
        if outcome:
            if me == 0:
                shutil.rmtree(tmp, ignore_errors=True)
            kind, _, message = outcome.partition(": ")
            raise (ConfigError if kind == "ConfigError" else CheckpointError)(message)


def _file_error(path: str, rank: int, err: BaseException) -> BaseException:
    """A worker's failure to write its own file, in one line naming the path, the rank and the OS error."""
    cause = err.__cause__ if isinstance(err, CheckpointError) and isinstance(err.__cause__, OSError) else err
    if isinstance(cause, OSError) and cause.errno is not None:
        return CheckpointError(f"rank {rank} could not write the checkpoint {path!r}: {os.strerror(cause.errno)} "
                               f"({errno.errorcode.get(cause.errno, cause.errno)}); expected room for every "
                               "worker's part. The previous checkpoint at that path is untouched: free space or "
                               "save elsewhere.")
    return err


def _fsync_dir(directory: str) -> None:
    fd = os.open(directory or ".", os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _post_saved(path: str | os.PathLike) -> None:
    """Leave the newest checkpoint's path in the group's store: a launcher whose job ends names it."""
    store = group.store()
    if store is not None:
        try:
            store.set(LAST_SAVED_KEY, os.path.abspath(os.fspath(path)))
        except Exception:  # noqa: BLE001 - only a hint for the launcher's last line; the file is written
            pass


def wait_for_saves() -> None:
    """Wait for this worker's asynchronous checkpoint, if one is being written (``px.shutdown()`` calls it)."""
    if group.is_initialized() and group.current().saving is not None:
        group.current().saving.wait()


# -- loading --------------------------------------------------------------------------------------------------------

def load_checkpoint(path: str | os.PathLike, model: nn.Module, optimizer: torch.optim.Optimizer | None = None, *,
                    loader: Any = None, restore_rng: bool = True, scheduler: Any = None,
                    scaler: Any = None) -> dict[str, Any]:
    """Restore what :func:`save_checkpoint` wrote; returns ``{"step", "extra", "world_size"}``.

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
    found = _resolve(os.fspath(path))
    if os.path.isdir(found):
        return _load_directory(found, state, restore_rng=restore_rng)
    return _load_file(found, state, restore_rng=restore_rng)


def read_checkpoint(path: str | os.PathLike) -> dict[str, Any]:
    """A checkpoint as plain data: ``{"format", "world_size", "step", "extra", "ranks"}``; nothing runs.

    For a checkpoint directory each entry of ``ranks`` holds that worker's ``model``,
    ``optimizer`` (keyed by parameter name, as ``get_state_dict`` gives it), ``strategy``,
    ``replica``, ``loader``, ``rng``, ``scheduler``, ``scaler`` and ``extra``, with every
    tensor whole (unsharded). A one-file checkpoint (or any framed phalanx file) is returned
    as it was written.
    """
    found = _resolve(os.fspath(path))
    if not os.path.isdir(found):
        return read_verified(found)
    marker = _read_marker(found)
    ranks = [_read_rank_file(found, r) for r in range(marker["world_size"])]
    tensors = _load_whole(found, sorted({k for rank in ranks for k in _refs(rank["skeleton"])}))
    for r, rank in enumerate(ranks):
        parts = _join(rank.pop("skeleton"), tensors)
        own = parts.get(f"rank{r}") or {}
        rank.update(model=parts["model"], optimizer=parts.get("optim"), strategy=parts.get("strategy"),
                    replica=own.get("replica"), buffers=own.get("buffers"))
    return {"format": DCP_FORMAT, "world_size": marker["world_size"], "step": marker["step"],
            "extra": ranks[0]["extra"], "ranks": ranks}


def export(checkpoint: str | os.PathLike, out: str | os.PathLike) -> dict[str, torch.Tensor]:
    """Write the plain model ``state_dict`` of ``checkpoint`` (rank 0's, unsharded) to ``out``; returns it.

    The file is what :func:`save` writes: it loads into the unwrapped model with
    ``Net().load_state_dict(torch.load(out, weights_only=True))``. ``phalanx export CKPT OUT``.
    """
    found = _resolve(os.fspath(checkpoint))
    if os.path.isdir(found):
        _read_marker(found)
        skeleton = _read_rank_file(found, 0)["skeleton"]["model"]
        state = _join(skeleton, _load_whole(found, _refs(skeleton)))
    else:
        body = read_verified(found)
        if body.get("format") != FORMAT:
            raise CheckpointError(f"{found!r} is a phalanx file of format {body.get('format')!r}; expected a "
                                  "checkpoint from px.save_checkpoint. Export a checkpoint, not another file.")
        _check_structure(body, found)
        state = body["ranks"][0]["model"]
    atomic_write(out, to_bytes(dict(state)))
    return state


def _resolve(path: str) -> str:
    """The checkpoint at ``path``; if a save was killed between its two renames, the previous one beside it."""
    if os.path.lexists(path):
        return path
    directory, base = os.path.split(os.path.abspath(path))
    olds = [os.path.join(directory, n) for n in (os.listdir(directory) if os.path.isdir(directory) else ())
            if n.startswith(f"{base}.old-") and os.path.exists(os.path.join(directory, n, MARKER))]
    return max(olds, key=os.path.getmtime) if olds else path


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


def _read_marker(path: str) -> dict[str, Any]:
    try:
        with open(os.path.join(path, MARKER), "rb") as f:
            marker = json.loads(f.read().decode())
    except FileNotFoundError:
        raise CheckpointError(f"{path!r} is not a complete phalanx checkpoint (it lacks {MARKER}, written last); "
                              "expected a directory px.save_checkpoint finished. Resume from an earlier "
                              "checkpoint.") from None
    except ValueError as err:
        raise CheckpointError(f"{path!r} has a damaged {MARKER} ({err}); expected the JSON px.save_checkpoint "
                              "writes. Resume from an earlier checkpoint.") from None
    ok = isinstance(marker, dict) and marker.get("format") == DCP_FORMAT and \
        all(type(marker.get(k)) is int for k in ("world_size", "step")) and marker["world_size"] >= 1
    if not ok:
        raise CheckpointError(f"{path!r} has a {MARKER} that is not phalanx's ({str(marker)[:120]}); expected "
                              f"format {DCP_FORMAT!r} with a world size and step. Resume from a checkpoint "
                              "px.save_checkpoint wrote, unedited.")
    return marker


def _read_rank_file(path: str, rank: int) -> dict[str, Any]:
    body = read_verified(os.path.join(path, f"rank-{rank}.pt"))
    if body.get("format") != DCP_FORMAT or body.get("rank") != rank or not isinstance(body.get("skeleton"), dict) \
            or "model" not in body["skeleton"]:
        raise CheckpointError(f"{path!r}: rank-{rank}.pt has the framing of a phalanx checkpoint but not its "
                              "structure; expected a worker's file from px.save_checkpoint. Resume from a "
                              "checkpoint px.save_checkpoint wrote, unedited.")
    return body


def _load_directory(path: str, state: TrainingState, *, restore_rng: bool) -> dict[str, Any]:
    marker = _read_marker(path)
    me, world = group.rank(), group.world_size()
    same = marker["world_size"] == world
    own = _read_rank_file(path, me if same else 0)
    skeleton = own["skeleton"]
    metadata = _safe_reader(path).read_metadata()
    model = unwrap(state.model)
    optimizer = state.optimizer if skeleton.get("optim") is not None else None
    msd, osd = _live_state(model, optimizer)
    _check_same_model(path, skeleton["model"], msd, metadata)
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
    targets = {k: _target(k, metadata.state_dict_metadata[k], live, msd) for k in keys}
    if targets:
        _dcp_load(path, targets)
    parts = _join(wanted, targets)
    sd = _dcp().state_dict
    try:
        with _grads_present(optimizer):
            if optimizer is not None:
                sd.set_state_dict(model, optimizer, model_state_dict=parts["model"], optim_state_dict=parts["optim"],
                                  options=sd.StateDictOptions(strict=True))
            else:
                sd.set_model_state_dict(model, parts["model"], options=sd.StateDictOptions(strict=True))
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


def _load_whole(path: str, keys: list[str]) -> dict[str, torch.Tensor]:
    """The tensors ``keys`` of a checkpoint directory, whole (unsharded), in this process alone."""
    metadata = _safe_reader(path).read_metadata().state_dict_metadata
    lacking = [k for k in keys if k not in metadata]
    if lacking:
        raise CheckpointError(f"{path!r} is damaged: its DCP metadata lacks {', '.join(lacking[:5])}; expected "
                              "every tensor its workers' files name. Resume from an earlier checkpoint.")
    tensors = {k: torch.empty(tuple(metadata[k].size), dtype=metadata[k].properties.dtype) for k in keys}
    if tensors:
        _dcp_load(path, tensors)
    return tensors


def _dcp_load(path: str, targets: dict[str, torch.Tensor]) -> None:
    """DCP's load into ``targets``, in this process alone; a damaged data file is one CheckpointError."""
    try:
        with _quiet():
            _dcp().load(targets, storage_reader=_safe_reader(path), no_dist=True)
    except CheckpointError:
        raise
    except (Exception, _dcp().api.CheckpointException) as err:  # noqa: BLE001 - a damaged file
        first = next(iter(str(err).strip().splitlines()), type(err).__name__)
        raise CheckpointError(f"{path!r} could not be read: its DCP data is truncated or corrupted "
                              f"({type(err).__name__}: {first[:200]}); expected an intact checkpoint. Resume from "
                              "an earlier checkpoint.") from None


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


def _safe_reader(path: str) -> Any:
    """DCP's file reader for ``path``, with its metadata read by :class:`_MetadataUnpickler` and tensors only."""
    return _safe_reader_class()(path)


@functools.cache
def _safe_reader_class() -> type:
    """The reader's class: it derives from DCP's, which is imported at the first checkpoint (see :func:`_dcp`)."""
    return type("_SafeReader", (_dcp().FileSystemReader,), {"read_metadata": _read_metadata})


def _read_metadata(self, *args: Any, **kwargs: Any) -> Any:
    where = os.path.join(os.fspath(self.path), ".metadata")
    try:
        with open(where, "rb") as f:
            metadata = _MetadataUnpickler(f).load()
    except FileNotFoundError:
        raise CheckpointError(f"{os.fspath(self.path)!r} lacks DCP's .metadata; expected a whole checkpoint "
                              "directory. Resume from an earlier checkpoint.") from None
    except Exception as err:  # noqa: BLE001 - anything unreadable is one refusal
        raise CheckpointError(f"{where!r} could not be read safely ({type(err).__name__}: "
                              f"{str(err)[:200]}); expected DCP metadata of tensors only. Refusing it: do not "
                              "load checkpoints from untrusted sources.") from None
    if not isinstance(metadata, _dcp().metadata.Metadata) or not all(
            isinstance(v, _dcp().metadata.TensorStorageMetadata) for v in metadata.state_dict_metadata.values()):
        raise CheckpointError(f"{where!r} describes entries other than tensors; expected the metadata "
                              "px.save_checkpoint writes (objects would be unpickled). Refusing it.")
    if getattr(metadata, "storage_meta", None) is None:
        metadata.storage_meta = _dcp().metadata.StorageMeta()
    metadata.storage_meta.load_id = self.load_id
    return metadata


# -- the one-file format of earlier versions ------------------------------------------------------------------------

def _load_file(path: str, state: TrainingState, *, restore_rng: bool) -> dict[str, Any]:
    """Restore ``state`` from a one-file checkpoint (this worker's snapshot, or rank 0's shared part)."""
    body = read_verified(path)
    if body.get("format") == "phalanx-ps-shards-1":
        raise CheckpointError(f"{path!r} is a parameter-server shard file; expected a file from "
                              "px.save_checkpoint. Give shard files to the servers (--checkpoint PATH), "
                              "not to px.load_checkpoint.")
    if body.get("format") != FORMAT:
        raise CheckpointError(f"{path!r} is a phalanx file of format {body.get('format', 'phalanx-checkpoint-1')!r}; "
                              f"expected {FORMAT!r} or a checkpoint directory (from px.save_checkpoint). Resume "
                              "from a checkpoint written by this version, or start afresh.")
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
