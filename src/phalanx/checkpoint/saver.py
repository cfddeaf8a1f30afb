"""Saving: ``px.save`` (the plain weights, main worker only) and ``px.save_checkpoint`` (every worker, with DCP).

:func:`save_state` orders one collective save: every worker enters
(:mod:`~phalanx.checkpoint.agreement`), settles its step, splits its state into DCP's
tensors and its own small file (:mod:`~phalanx.checkpoint.dcp`), the workers agree that
every file was written, DCP writes the tensors (at once, or from a staged copy in a
thread), and rank 0 puts the directory in place (:mod:`~phalanx.checkpoint.handle`).
"""
from __future__ import annotations

import os
import traceback
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..group import group
from ..group.records import Record, Slot
from ..framing import atomic_write, check_plain, to_bytes, write_verified
from ..sharding.layout import is_sharded
from ..group.spans import span
from ..step.protocols import replicas_agree
from .training_state import TrainingState
from ..wrap import clock_of, unwrap
from .agreement import _agree, _agree_on_temporary, _all_enter, peer_lost
from .dcp import _dcp, _quiet, _snapshot
from .handle import SaveHandle, _abandon, _finish, _write_error
from .staging import step_fences
from .writer import WRITERS, Staging, _local, storage_writer


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


class Saving(Slot[SaveHandle]):
    """The group's record of the checkpoint this worker writes (or wrote last): the next save and leaving wait."""

    def __init__(self) -> None:
        super().__init__()
        self.timeout_s: float | None = None  # the group's bound, for a worker that leaves on an error

    def before_leaving(self, failing: bool) -> None:
        """Wait for the save; on an error at most the group's timeout, so a stalled write cannot hold the exit."""
        handle, self.value = self.value, None
        if handle is None:
            return
        try:
            handle.finish(timeout=self.timeout_s if failing else None)  # its error once: not if wait() raised it
        except Exception:
            if not failing:
                raise


SAVING: Record[Saving] = Record("checkpoint being written", Saving)


def save_checkpoint(path: str | os.PathLike, model: nn.Module, optimizer: torch.optim.Optimizer | None = None, *,
                    loader: Any = None, step: int = 0, extra: dict[str, Any] | None = None,
                    scheduler: Any = None, scaler: Any = None, blocking: bool = True) -> SaveHandle | None:
    """Write a resumable checkpoint directory of every worker's state with DCP. Collective: call it on every worker.

    Each worker writes its own part; the directory appears at ``path`` only once every
    worker is done (a previous checkpoint there is replaced then, never before). With
    ``blocking=True`` every worker returns once it is in place, or raises (a full disk
    names the path). With ``blocking=False`` it returns a :class:`SaveHandle` at once: the
    parameters and the optimizer's state are copied into shared memory beside training, and the
    next ``optimizer.step()`` waits for that copy if it is not done (the rest is copied in the
    call: :mod:`phalanx.checkpoint.staging`); a writer process of this worker's own writes, seals
    and renames the files while training continues (:mod:`phalanx.checkpoint.writer`). A parameter
    written by hand before that step fails this save (the previous checkpoint stays);
    the next save and ``px.shutdown()`` wait for it. Called on some workers only, it raises within
    the group's timeout (:data:`~phalanx.checkpoint.agreement.ENTRY_WAIT_S`) saying so.

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
    with span("phalanx/checkpoint"):  # the timeline (phalanx.step.profiling)
        handle = save_state(path, TrainingState(model, optimizer, loader=loader, scheduler=scheduler, scaler=scaler,
                                                extra=extra, step=step), blocking=blocking)
    return None if blocking else handle


def save_state(path: str | os.PathLike, state: TrainingState, *, blocking: bool = True) -> SaveHandle:
    """Write ``state`` of every worker as one DCP checkpoint directory at ``path``; see :func:`save_checkpoint`."""
    g = group.current()
    saving = SAVING.of(g)
    previous, saving.value = saving.value, None
    saving.timeout_s = g.timeout_s
    if previous is not None:
        # One checkpoint in flight at a time. Its error surfaces here unless a wait() already raised it: the
        # caller handled that one, and a stale error must not refuse a save to another path (or disk).
        previous.finish()
    path = os.path.abspath(os.fspath(path))
    key = _all_enter("save_checkpoint")
    state.settle()  # a step this worker skipped is closed (its exchange runs on every worker) before capture
    me, world = group.rank(), group.world_size()
    tmp = _agree_on_temporary(path, key)
    tensors, rank_file = _snapshot(state, me)
    writers = WRITERS.of(g)
    staging = None
    try:
        os.makedirs(tmp, exist_ok=True)
        write_verified(os.path.join(tmp, f"rank-{me}.pt"), rank_file)
        if not blocking:
            # The snapshot into the writer process's shared memory (a fork copying after the call, or the copy
            # here): the part of an asynchronous save that blocks training. Here, before the agreement, so that a
            # worker that cannot (no memory) stops them all.
            staging = Staging(writers.process(g))
            staging.copy(tensors, *_written_by_the_step(state))
        failure = None
    except Exception as err:  # noqa: BLE001 - every worker must learn of it before the collective write starts
        failure = err
    _agree("rank-files", key, failure, path, tmp)
    pg = _checkpoint_group(previous, g)
    strategy = state.strategy
    # Replicated tensors are written once: spread over the workers when replicas agree, by rank 0 otherwise
    # (its model is the one every worker takes when resuming on another number of workers).
    dedup = strategy is not None and not replicas_agree(strategy, strategy.steps)
    planner = _dcp().default_planner.DefaultSavePlanner(dedup_save_to_lowest_rank=dedup)
    writer = _writer(tmp)
    distributed = dist.is_initialized() and world > 1
    kwargs = dict(storage_writer=writer, planner=planner, process_group=pg, no_dist=not distributed)
    handle = SaveHandle(path, None, key, me, pg, g.generation, group.store())
    if blocking:
        try:
            with _quiet():
                _dcp().save(tensors, **kwargs)
        except (Exception, _dcp().api.CheckpointException) as err:  # noqa: BLE001 - raised on every rank
            # A peer killed mid-write is a lost peer (elastic regroups on the type), not a bad checkpoint:
            # the save is abandoned and the previous checkpoint at `path` stays.
            lost = peer_lost(err, f"writing the checkpoint {path!r}")
            failure = lost if lost is not None else _write_error(path, err)
            if me == 0:
                # Said to the others in every case: a peer lost after its part reached rank 0 fails only rank 0's
                # last answer, and the others, whose DCP call returned, wait for rank 0's word on the rename.
                try:
                    _abandon(tmp, key, failure, store=group.store())
                except dist.DistError:  # the store went with the peers: nobody waits there, the failure stands
                    pass
            if lost is not None:
                # The others may still be blocked on this worker in DCP's last exchange on the checkpoint group,
                # whose bound is torch's 30 minutes: gloo closes its sockets only when the group is freed, and the
                # frames of the failed call (held by `err`'s traceback) hold it. The generation is broken anyway.
                del pg, kwargs, handle
                _let_go(err)
                g.drop_process_groups()
            raise failure from err
        _finish(handle, tmp, world, state.step, blocking=True)
        saving.value = handle  # done; kept for its process group
        return handle
    # Staged above; DCP's protocol runs in a thread, the files are written, and on rank 0 sealed and put in place,
    # by the writer process (phalanx.checkpoint.writer).
    assert staging is not None
    process = staging.writer
    kwargs["storage_writer"] = storage_writer(staging, writer, path, g.generation)
    handle._future = _dcp().async_save(tensors, async_stager=staging, **kwargs)
    saving.value = handle
    if me == 0:
        handle._future.add_done_callback(lambda fut: _finish(handle, tmp, world, state.step, blocking=False,
                                                             commit=process.commit))
    if not group.is_initialized():  # a plain process's group of one lasts one call: its writer lasts one save
        handle._future.add_done_callback(lambda fut: writers.stop())
    return handle


def _written_by_the_step(state: TrainingState) -> tuple[frozenset[int], Any]:
    """What an asynchronous save may copy beside training, and its fences (:mod:`phalanx.checkpoint.staging`).

    The parameters and the optimizer's state (their local shards' addresses), which only the optimizer's step
    writes, under a torch optimizer; nothing without one (a Keras optimizer writes its variables elsewhere).
    """
    optimizer = state.optimizer
    if not isinstance(optimizer, torch.optim.Optimizer):
        return frozenset(), None
    local = [_local(p) for group_ in optimizer.param_groups for p in group_["params"]]
    local += [_local(v) for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    clock = clock_of(unwrap(state.model))
    return (frozenset(t.data_ptr() for t in local if t.device.type == "cpu"),
            step_fences(state.model, (lambda: clock.pending) if clock is not None else (lambda: False)))


def _let_go(err: BaseException) -> None:
    """Clear the locals of the finished frames behind ``err`` (its traceback, causes, DCP's per-rank failures)."""
    seen: set[int] = set()
    todo = [err]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        traceback.clear_frames(e.__traceback__)
        todo += [e.__cause__, e.__context__]
        for failure in (getattr(e, "failures", None) or {}).values():  # DCP's CheckpointException: {rank: (exc, tb)}
            todo += [f for f in (failure if isinstance(failure, tuple) else (failure,)) if isinstance(f, BaseException)]


def _writer(tmp: str) -> Any:
    """DCP's writer for the temporary directory, hashing as it writes (a test replaces it to hold a write half-way)."""
    from .hashing import HashingFileSystemWriter  # (imports DCP: at the first save, never with phalanx)
    return HashingFileSystemWriter(tmp, sync_files=True)


def _checkpoint_group(previous: SaveHandle | None, g: group.Group) -> Any:
    """A gloo process group for checkpoint writes only (collective to create; one per group generation).

    An asynchronous save runs DCP's collectives from a background thread while training runs its own:
    on the same process group their messages would interleave.
    """
    if not dist.is_initialized() or g.world_size == 1:
        return None
    reused = previous.pg if previous is not None and previous.generation == g.generation else None
    if reused is not None:  # read once: the handle holds it weakly
        return reused
    # the group's own split of its generation (formed on the generation's keys where the group owns its groups)
    # torch's bound for a new group (30 min), not the job's collective bound: a large write on one worker keeps
    # the others waiting in DCP's final gather that long.
    return g.split([list(range(g.world_size))], "checkpoint", backend="gloo",
                   timeout_s=dist.constants.default_pg_timeout.total_seconds())


def wait_for_saves() -> None:
    """Wait for this worker's asynchronous checkpoint, if one is being written (``px.shutdown()`` calls it)."""
    handle = SAVING.of(group.current()).value if group.is_initialized() else None
    if handle is not None:
        handle.finish()
