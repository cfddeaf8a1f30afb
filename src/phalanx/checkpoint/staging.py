"""An asynchronous save's copy into the writer's shared region (:class:`Region`): part in the call, the rest beside
training.

Training writes its parameters and the optimizer's moments only in ``optimizer.step()`` (phalanx's
rules too: their exchanges that change parameters run in the step's hooks, or in the next forward for
a step that was skipped). So the copy of those tensors need not hold the call: it runs on threads
beside the next forward and backward, and the first of these waits for it, the **fence**:

* the next ``optimizer.step()`` of any torch optimizer (a global step pre-hook: it runs before the
  optimizer's own hooks, where phalanx's rules act);
* the next forward of the saved model while a step is pending in its clock (a skipped step, which
  that forward closes, runs the rule's exchange);
* the write of this save, the next save, a regroup's end of the writer, ``handle.wait()``.

This is torch's own ``AsyncStager`` with ``synchronize_staging`` before the next step (torchtitan
calls it by hand), done by the hooks so that the user's loop stays as it was. Everything else (buffers,
which a forward writes; a rule's own state; anything on a GPU) is copied in the call, as before.

A tensor written in place while it was being copied (by hand, between the save and the next step) is
found by its version counter, and its save fails with a :class:`~phalanx.errors.CheckpointError` naming
it, never written torn; the previous checkpoint stays.

Example:
    >>> import torch
    >>> src, dst = torch.arange(6.0), torch.zeros(6)
    >>> copy = StateCopy()
    >>> copy.start(now=[], later=[(dst, src)]); copy.finish("the example"); dst.tolist()
    [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
    >>> copy.close()
"""
from __future__ import annotations

import mmap
import os
import threading
import time
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from ..errors import CheckpointError

ALIGN = 64  # each staged tensor starts on a cache line
SLICE = 4 << 20  # elements a thread copies at a time (16 MiB of float32): the cores share the work
COPIERS = 8  # at most this many threads copy

Pair = tuple[torch.Tensor, torch.Tensor]  # (destination in the shared region, source)
Fences = Callable[["StateCopy"], list[Any]]  # registers the hooks that fence a copy; returns their handles


class TornCopy(CheckpointError):
    """A tensor of an asynchronous save was written while its copy was being taken: that save is abandoned."""


class StateCopy:
    """The copy of one save's tensors: :meth:`start` copies ``now`` and starts ``later``; :meth:`fence` waits."""

    def __init__(self) -> None:
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()
        self._fencing = threading.Lock()
        self._running: list[Future] = []
        self._versions: list[tuple[torch.Tensor, int]] = []
        self._hooks: list[Any] = []
        self._owner: int | None = None  # the thread that registered them (the training loop's)
        self._spent = True
        self._torn: list[str] = []
        self._names: dict[int, str] = {}
        self.waited = 0.0  # seconds the fences of the last save held the thread that saved (the call's copy aside)

    def start(self, now: list[Pair], later: list[Pair], names: dict[int, str] | None = None,
              fences: Fences | None = None) -> None:
        """Copy ``now`` here, over every core; start ``later``'s copy beside training, fenced by ``fences(self)``.

        ``fences`` registers the hooks that call :meth:`fence` and returns their handles (removed by the first
        forward after the copy, or by the next save).
        """
        self.fence()
        self.unhook()
        self._torn, self._names, self.waited = [], dict(names or {}), 0.0
        cores = _cores()
        _copy_all(_slices(now), self._executor(cores) if cores > 1 else None, cores)
        if not later:
            return
        self._spent = False
        # training goes on with its own threads: the copy takes what they leave (one core at least)
        copiers = max(1, min(COPIERS, cores - torch.get_num_threads()))
        slices = _slices(later)
        with self._lock:
            self._versions = [(src, src._version) for _, src in later]
            self._running = [self._executor(cores).submit(_copy_beside, slices[i::copiers]) for i in range(copiers)]
        # left in place once they ran (no-ops then) and removed by the next forward or save, on this thread: torch
        # runs an optimizer's pre-hooks by iterating their dict, which a removal from inside one of them would change
        self._hooks, self._owner = (fences(self) if fences is not None else []), threading.get_ident()

    def fence(self) -> None:
        """Block until the copy started beside training is done and checked; a no-op when none is. Never raises.

        One fencer at a time: a second (the save's write in DCP's thread, the step's hook in training's) waits for
        the first's check too, so none returns before the versions are read, which the step then changes.
        """
        started = time.perf_counter()
        with self._fencing:
            with self._lock:
                running, self._running = self._running, []
                versions, self._versions = self._versions, []
            if running:
                for f in running:
                    try:
                        f.result()
                    except BaseException as err:  # noqa: BLE001 - said by finish(), to the save's own wait
                        self._torn.append(f"the copy failed: {err!r}")
                # a version moved while the copy ran: written in place during it (the step waits here, so not by it)
                self._torn += [self._names.get(id(src), f"a tensor of shape {tuple(src.shape)}")
                               for src, version in versions if src._version != version]
                self._spent = True  # only now: another fencer may be waiting above while the list reads empty
        if threading.get_ident() == self._owner:  # training's wait (another fencer's, in DCP's thread, is not)
            self.waited += time.perf_counter() - started

    def finish(self, what: str) -> None:
        """:meth:`fence`, then raise :class:`TornCopy` if a tensor was written while it was copied."""
        self.fence()
        if self._torn:
            torn, self._torn = self._torn, []
            raise TornCopy(f"{what}: {', '.join(torn[:3])}{' and others' if len(torn) > 3 else ''} changed while "
                           "the asynchronous save was copying it (a write in place between px.save_checkpoint(..., "
                           "blocking=False) and the next optimizer.step()); this checkpoint is abandoned and the "
                           "previous one at that path is untouched. Write parameters by hand only after the next "
                           "step, or call handle.wait() first.")

    def close(self) -> None:
        """Fence, then stop the threads (the writer's end)."""
        self.fence()
        if threading.get_ident() == self._owner:  # elsewhere: left as no-ops (see start)
            self.unhook()
        if self._pool is not None:
            self._pool.shutdown(wait=False)
            self._pool = None

    def spent(self) -> bool:
        """Whether no copy runs beside training: none started, or a fence saw it end (and checked it)."""
        return self._spent

    def unhook(self) -> None:
        """Remove the fences' hooks (on the training thread, outside an optimizer's own hook loop)."""
        hooks, self._hooks = self._hooks, []
        for h in hooks:
            h.remove()

    def _executor(self, cores: int) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=min(cores, COPIERS), thread_name_prefix="phalanx-stage")
        return self._pool


class Region:
    """A shared-memory region (memfd) holding one tensor of each ``layout`` entry, and the worker's views of it."""

    def __init__(self, layout: list[tuple[str, torch.dtype, tuple[int, ...]]]) -> None:
        self.layout = layout
        self.entries: list[tuple[str, torch.dtype, tuple[int, ...], int]] = []
        offset = 0
        for key, dtype, shape in layout:
            self.entries.append((key, dtype, shape, offset))
            nbytes = numel(shape) * torch.empty((), dtype=dtype).element_size()
            offset += -(-nbytes // ALIGN) * ALIGN
        self.size = max(offset, ALIGN)
        self.fd = os.memfd_create("phalanx-checkpoint-staging", os.MFD_CLOEXEC)
        os.ftruncate(self.fd, self.size)
        # populated now: the pages are faulted in once here, not at each save's copy
        self.map = mmap.mmap(self.fd, self.size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
        self.views = views(self.map, self.entries)
        self.ident = uuid.uuid4().int >> 64  # names it to the writer, which maps each region once

    def __del__(self) -> None:
        self.views = {}
        try:
            self.map.close()
        except (BufferError, AttributeError):
            pass  # a staged tensor still refers to it: the mapping goes with the last one
        try:
            os.close(self.fd)
        except (OSError, AttributeError):
            pass


def numel(shape: tuple[int, ...]) -> int:
    """The number of elements of ``shape``."""
    n = 1
    for s in shape:
        n *= s
    return n


def views(buffer: Any, entries: list) -> dict[str, torch.Tensor]:
    """A tensor of each entry over ``buffer`` (each with a storage of its own size: DCP writes it without a copy)."""
    views = {}
    for key, dtype, shape, offset in entries:
        n = numel(shape)
        views[key] = torch.frombuffer(buffer, dtype=dtype, count=n, offset=offset).view(shape) if n else \
            torch.empty(shape, dtype=dtype)
    return views


def step_fences(model: torch.nn.Module | None, pending: Callable[[], bool]) -> Fences:
    """The fences of a save of ``model``: any optimizer's next step; ``model``'s next forward if ``pending()``.

    Example:
        >>> copy = StateCopy(); hooks = step_fences(torch.nn.Linear(1, 1), lambda: False)(copy)
        >>> len(hooks)
        2
        >>> for h in hooks: h.remove()
    """
    def register(copy: StateCopy) -> list[Any]:
        def before_forward(*_: Any) -> None:
            if pending():
                copy.fence()
            elif copy.spent():
                # every hook of this save goes here, a forward after its copy ended: torch calls a module's hooks
                # from a tuple, so this one may go too, where the optimizer's (iterated live) may not remove itself
                copy.unhook()

        hooks = [register_optimizer_step_pre_hook(lambda *_: copy.fence())]
        if model is not None:
            hooks.append(model.register_forward_pre_hook(before_forward, prepend=True))
        return hooks
    return register


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def _slices(pairs: list[Pair]) -> list[Pair]:
    """Each pair, a large contiguous CPU one cut into :data:`SLICE`-element pieces."""
    out: list[Pair] = []
    for dst, src in pairs:
        if src.device.type == "cpu" and src.is_contiguous() and src.dtype == dst.dtype and src.numel() > SLICE:
            d, s = dst.view(-1), src.reshape(-1)
            out += [(d[i:i + SLICE], s[i:i + SLICE]) for i in range(0, s.numel(), SLICE)]
        else:
            out.append((dst, src))
    return out


def _copy_each(pairs: list[Pair]) -> None:
    with torch.no_grad():
        for dst, src in pairs:
            dst.copy_(src)


def _copy_beside(pairs: list[Pair]) -> None:
    """One thread's share of the copy beside training (its own name: a test holds it)."""
    _copy_each(pairs)


def _copy_all(pairs: list[Pair], pool: ThreadPoolExecutor | None, cores: int) -> None:
    """Copy every pair now, spread over ``pool``'s threads when there are two or more.

    The call waits for this copy whatever it is, and a phalanx worker computes with one thread: one thread's copy
    leaves the other cores' share of the memory bandwidth unused (``copy_`` runs on torch's intra-op threads, which a
    worker keeps at one). ``copy_`` releases the GIL, so Python threads copy in parallel.
    """
    if pool is None or len(pairs) < 2:
        _copy_each(pairs)
        return
    n = min(cores, COPIERS, len(pairs))
    for f in [pool.submit(_copy_each, pairs[i::n]) for i in range(n)]:
        f.result()
