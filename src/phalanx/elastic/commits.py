"""``px.elastic.State`` and ``px.elastic.run``: commit in memory, roll back, go on.

A commit is this worker's training state captured in memory (model, optimizer,
strategy, data position, RNG, step): no collective, no disk. When a peer dies the
survivors leave the broken group, agree on the next generation and on the newest
commit they all hold, rebuild the group without the dead, restore that commit and
re-enter the training function. The data position is counted in samples, so the
rest of the epoch is re-split over the new world size: no sample is dropped or
trained twice.

Under plain ``torchrun`` or ``python`` (no ``phalanx run --elastic``) the same script
runs unchanged: commits are skipped and a failure ends the job as usual.

Example:
    >>> import torch, phalanx as px
    >>> net = torch.nn.Linear(2, 1)
    >>> net, opt = px.wrap(net, torch.optim.SGD(net.parameters(), lr=0.1))
    >>> state = px.elastic.State(net, opt, commit_every=5)
    >>> @px.elastic.run
    ... def train(state):
    ...     for _ in range(3):
    ...         opt.zero_grad(); net(torch.ones(1, 2)).sum().backward(); opt.step()
    ...     return state.step
    >>> train(state)
    3
"""
from __future__ import annotations

import copy
import functools
import os
import sys
import time
import warnings
from typing import Any, Callable, Iterator, TypeVar

import torch
import torch.distributed as dist

from ..group import group
from ..checkpoint import checkpoint_step, load_checkpoint, save_checkpoint
from ..group.collectives import broadcast_object
from ..errors import ConfigError, WorkerLostError, usage
from ..sharding.reshard import ShardLostError, local_parts, reshard, reshard_empty
from ..sharding.layout import sharded_by
from ..group.spans import span
from ..step.preempt import PREEMPTION
from ..wrap import strategy_of
from .membership import QuorumError
from ..step.protocols import replicas_agree
from .resize import ResizePolicy, check_policy
from .rule import CommitPoint, Regroupable
from .worker import ElasticWorker, place

from ..checkpoint.training_state import TrainingState, shared

DEFAULT_COMMIT_EVERY = 10
KEEP = 2  # commits held; survivors roll back to the newest one they all hold
F = TypeVar("F", bound=Callable[..., Any])


class State:
    """What a worker rolls back to: a :class:`TrainingState` captured in memory every ``commit_every`` steps.

    Args:
        model, optimizer, loader, scheduler: the objects to capture (the optimizer is required,
            as ``px.wrap`` returned it: its strategy counts the steps).
        commit_every: commit after every this many steps of the framework's step count
            (``px.strategy_of(optimizer).steps``, the same on every rank, steps a GradScaler
            skipped included), at the strategy's next sync point; None commits only when you
            call :meth:`commit`.
        extra: more objects with ``state_dict``/``load_state_dict`` to roll back with the rest
            (their state is deep-copied at every commit).
        resize: what a membership change keeps: ``px.elastic.KeepWorkerBatch()`` (default: the
            global batch follows the world size) or ``px.elastic.KeepGlobalBatch()`` (the
            per-worker batch is re-split); see :mod:`phalanx.elastic.resize`.
        checkpoint: a directory that every commit also writes (``px.save_checkpoint``, blocking):
            the fallback of a sharded model with one replica group (``px.FullyShard(group_size=N)``),
            whose lost worker takes a shard no survivor holds. The survivors then roll back to the
            commit of that checkpoint's step and load the model and optimizer from it, resharded.

    A commit is taken between two steps: where a ``px.shard`` loader is about to hand out
    the next batch (the step before is over on every rank, and the loader's position still
    points at that batch), or, with any other loader, right after ``optimizer.step()``.
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None, loader: Any = None,
                 scheduler: Any = None, *, commit_every: int | None = DEFAULT_COMMIT_EVERY,
                 extra: dict[str, Any] | None = None, scaler: Any = None,
                 resize: ResizePolicy | None = None, checkpoint: str | os.PathLike | None = None) -> None:
        if commit_every is not None and (isinstance(commit_every, bool) or not isinstance(commit_every, int)
                                         or commit_every < 1):
            raise ConfigError(usage(f"commit_every={commit_every!r}", "an integer >= 1 or None",
                                    "Pass e.g. commit_every=10 (steps between in-memory commits)."))
        self.model, self.optimizer, self.loader = model, optimizer, loader
        self.training = TrainingState(model, optimizer, loader=loader, scheduler=scheduler, scaler=scaler)
        self.extra = dict(extra or {})
        self.resize = check_policy(resize)
        self.commit_every = commit_every
        self.checkpoint = checkpoint
        self.commits: dict[int, dict] = {}  # keyed by the framework's step
        self.history: list[dict] = []  # one entry per membership change
        self._checked = False
        # what ended the last attempt, kept until the group is rebuilt outside the except block that caught it:
        # ("failure", text, time) or ("joiners", ids)
        self._pending: tuple | None = None
        self._in_epochs = False
        self._leaving = False  # this worker asked to leave (it was sent SIGTERM/SIGUSR1)
        self._handles: list[Any] = []
        self._moved: dict[str, int] = {}  # bytes of sharded state the last reshard received, for the history
        self.worker = ElasticWorker.of(group.current())
        if self.worker is not None:
            self.worker.beat()
        if self.elastic:
            self._hook_commit_point()

    @property
    def elastic(self) -> bool:
        """True under ``phalanx run --elastic``; otherwise commits are skipped."""
        return self.worker is not None

    @property
    def step(self) -> int:
        """The framework's step count (``px.strategy_of(optimizer).steps``), rolled back with the commit.

        It advances identically on every rank, a step a GradScaler skipped on one rank included,
        so every rank commits at the same steps. 0 for an optimizer that ``px.wrap`` did not return.
        """
        clock = self._clock()
        return int(clock.step) if clock is not None else 0

    @property
    def epoch(self) -> int:
        """The epoch the loader is in (restored with the commit): start your epoch loop here."""
        sampler = getattr(self.loader, "sampler", None)
        return int(getattr(sampler, "epoch", 0))

    def supervise(self, fn: Callable[["State"], Any]) -> Any:
        """``fn(self)``, re-entered after every membership change: ``run(fn)(self)``, as the Trainer calls it."""
        return run(fn)(self)

    def _clock(self) -> Any:
        return getattr(self.training.strategy, "clock", None)

    def _hook_commit_point(self) -> None:
        before_batch = getattr(self.loader, "before_batch", None)
        if callable(before_batch):  # px.shard: between two steps, before the position moves past the next batch
            self._handles.append(before_batch(self.at_commit_point))
        elif self.optimizer is not None:  # any other loader: right after the step (a skipped step takes none)
            self._handles.append(self.optimizer.register_step_post_hook(lambda *_: self.at_commit_point()))

    def at_commit_point(self) -> None:
        """Between two steps: commit when one is due and admit the joiners waiting (``px.elastic`` calls it)."""
        clock = self._clock()
        if self.commit_every is None or not self.elastic or clock is None:
            return
        clock.settle()  # a step this rank's GradScaler skipped is closed: every rank now counts the same
        step = clock.step
        strategy = self.training.strategy
        preemption = PREEMPTION.of(group.current()).value
        if preemption is not None and preemption.signal is not None and not self._leaving:
            self._leaving = True  # SIGTERM to this worker (a node drained): leave at the next commit
            self.worker.membership.ask_to_leave()
        # Between sync points LocalSGD/DiLoCo replicas differ and may be steps apart; commit only where
        # every worker stands at the same step with the same model.
        if step - max(self.commits, default=0) >= self.commit_every and (strategy is None or
                                                                          replicas_agree(strategy, step)):
            self._commit_together()
            leavers = self.worker.membership.leavers(step)
            if self.worker.me in leavers:
                self.worker.leave(step)  # says goodbye and ends this process with PREEMPTED_EXIT
            if leavers:
                raise _Leave(leavers)  # the others regroup at this very commit: nothing is redone
            joiners = self.worker.membership.admit(step, self.worker.pending_joiners)
            if joiners:
                raise _Resize(joiners)  # out of the loop and the training function; the group grows outside it

    def commit(self) -> None:
        """Capture this worker's state in memory (no collective); keeps the newest two."""
        if not self._checked:
            self._check()
        if not self.elastic:
            return
        clock = self._clock()
        clock.settle()  # a skipped step is closed before the step count is read
        snap = self.training.capture()
        snap["elastic_step"] = step = clock.step
        snap["elastic_extra"] = {k: copy.deepcopy(v.state_dict()) for k, v in self.extra.items()}
        # the world the commit was taken in (its lr is that world's) and when: a rollback's cost in seconds
        snap["elastic_world_size"], snap["elastic_time"] = group.world_size(), time.time()
        snap["elastic_resize"] = self.resize.state_dict()
        if sharded_by(self.optimizer) is not None:  # this rank's shards, free of the mesh that dies with the group
            snap["model"], snap["optimizer"] = local_parts(snap["model"]), local_parts(snap["optimizer"])
        self.commits[step] = snap
        for old in sorted(self.commits)[:-KEEP]:
            del self.commits[old]

    def _commit_together(self) -> None:
        """A commit every member takes at the same step. An async PS settles around it."""
        strategy = strategy_of(self.optimizer) if self.elastic else None
        if isinstance(strategy, CommitPoint):
            strategy.commit_point()  # e.g. every worker's pushes up to this step are on the servers before the snapshot
        with span("phalanx/commit"):  # the timeline (phalanx.step.profiling)
            self.commit()
            if self.checkpoint is not None and self.elastic:
                save_checkpoint(self.checkpoint, self.model, self.optimizer, step=self.step)
        if isinstance(strategy, CommitPoint):
            strategy.commit_point()  # and no one's next push lands before every worker took it

    def _check(self) -> None:
        self._checked = True
        if self.optimizer is None:
            raise ConfigError(usage("px.elastic.State without an optimizer",
                                    "State(model, optimizer, loader, ...)",
                                    "Pass the optimizer: a rollback without its state (momentum, Adam moments) "
                                    "would not continue the run you had."))
        if self.elastic and self._clock() is None:
            raise ConfigError(usage("px.elastic.State with an optimizer px.wrap did not return",
                                    "the optimizer from model, opt = px.wrap(model, opt)",
                                    "Wrap first: the strategy's step count is the one every worker commits at."))
        ours = {id(p) for g in self.optimizer.param_groups for p in g["params"]}
        missing = [n for n, p in self.model.named_parameters() if p.requires_grad and id(p) not in ours]
        if missing:
            raise ConfigError(usage(f"an optimizer that does not hold {len(missing)} trainable parameter(s) of "
                                    f"the model (e.g. {missing[0]})", "the optimizer of this model",
                                    "Pass the optimizer built from model.parameters()."))
        self.resize.start(self.loader, group.world_size())

    def recover(self, failure: str, failed_at: float | None = None) -> None:
        """Leave the broken group, agree on the next one, roll back to the common commit (collective)."""
        started, failed_at = time.monotonic(), time.time() if failed_at is None else failed_at
        before = group.world_size()
        plan = self.worker.regroup(sorted(self.commits), backend=group.current().backend or "gloo")
        snap = self.commits[plan["step"]]
        for newer in [s for s in self.commits if s > plan["step"]]:
            del self.commits[newer]
        lost_steps = max(0, self.step - plan["step"])
        self._restore(snap)
        if plan["joined"]:  # spares/joiners the quorum admitted wait in join() for rank 0's commit
            self._send_state()
        try:
            self._reshard(snap)
        except ShardLostError as lost:
            snap = self._from_disk(lost, joined=bool(plan["joined"]))
            lost_steps = max(0, lost_steps + plan["step"] - snap["elastic_step"])
        self._resplit(snap["elastic_world_size"])
        self._note(plan, before, started, redone=lost_steps, cause=failure,
                   redone_s=max(0.0, failed_at - snap["elastic_time"]))


    def grow(self, joiners: list[str]) -> None:
        """Members at a commit point: rebuild with the joiners and send them rank 0's state (collective)."""
        started, before = time.monotonic(), group.world_size()
        plan = self.worker.grow(joiners, backend=group.current().backend or "gloo")
        self._send_state()
        self._reshard(self.commits[max(self.commits)])  # taken at this commit point: the live state
        self._resplit(before)
        self._note(plan, before, started, redone=0, cause="joined")

    def join(self) -> bool:
        """A joiner: wait for admission, then take rank 0's state; False if training had ended."""
        started = time.monotonic()
        while True:
            plan = self.worker.wait_for_admission()
            if plan is None:
                return False
            try:
                snap = self._send_state()
                # rank 0's model, optimizer, shared strategy state and data position; not its own RNG streams or
                # compressor residuals (its error feedback would be counted twice): a joiner starts those fresh.
                self._restore(shared(snap), joining=True)  # a joiner never puts the async PS back
                try:
                    self._reshard(None)  # a sharded model: its shards come from the members' commits
                except ShardLostError:
                    if self.checkpoint is None:
                        raise  # the members have no checkpoint either: they end with the same error
                    # admitted at the regroup where a shard died with its only holder: the members roll back to the
                    # checkpoint's commit (sent again) and everyone, this joiner too, loads its shards from it
                    snap = self._send_state()
                    self._restore(shared(snap), joining=True)
                    self._load_shards()
                break
            except Exception as err:  # noqa: BLE001 - a lost peer sends it back to the joiners; the rest is raised
                if not is_peer_failure(err):
                    raise
                self.worker.join_again(plan["generation"])  # no commit of its own yet: it is admitted again
        self._resplit(snap["elastic_world_size"])
        self.commits = {}
        self.commit()  # its own state as it now stands (its residuals and RNG, not rank 0's)
        self._note(plan, 0, started, redone=0, cause="joined")
        return True

    def _send_state(self) -> dict:
        """Rank 0's newest commit on every worker (a broadcast of its bytes; loaded weights-only).

        Of a sharded model, without its model and optimizer: their shards travel point to point in
        :meth:`_reshard`, each worker receiving only the rows of its new shards."""
        mine = self.commits[max(self.commits)] if group.rank() == 0 else None
        if mine is not None and sharded_by(self.optimizer) is not None:
            mine = {**mine, "model": None, "optimizer": None}
        return broadcast_object(mine, 0, "newest commit")

    def _from_disk(self, lost: ShardLostError, joined: bool = False) -> dict:
        """A shard of the commit died with its only holder (one replica group): roll back to the commit of the
        newest checkpoint's step, and load the model and optimizer from that checkpoint onto the survivors.

        ``joined``: joiners were admitted at this regroup; they take that commit from rank 0 and load the
        checkpoint with the survivors (:meth:`join`)."""
        step = checkpoint_step(self.checkpoint) if self.checkpoint is not None else None
        if step is None or step not in self.commits:
            raise ShardLostError(f"{lost} (px.elastic.State(checkpoint=...) holds "
                                 f"{'no checkpoint' if step is None else f'step {step}, no commit held here'})",
                                 lost.lost)
        for newer in [s for s in self.commits if s > step]:
            del self.commits[newer]
        snap = self.commits[step]
        self._restore(snap)
        if joined:
            self._send_state()  # the commit of the checkpoint's step: the newest one kept
        self._load_shards()
        if group.rank() == 0:
            print(f"phalanx: elastic: {lost.lost} of the commit died with its only holder; the model and optimizer "
                  f"of step {step} come from {os.fspath(self.checkpoint)!r}", file=sys.stderr, flush=True)
        return snap

    def _load_shards(self) -> None:
        """Lay the sharded model out over the new group and fill it from the checkpoint (collective)."""
        reshard_empty(sharded_by(self.optimizer), self.model, self.optimizer, self.training.strategy,
                      group.current())
        with warnings.catch_warnings():  # "taken with N workers": expected, the survivors are fewer
            warnings.simplefilter("ignore")
            load_checkpoint(self.checkpoint, self.model, self.optimizer, restore_rng=False)

    def _reshard(self, snap: dict | None) -> None:
        """A sharded model: lay the commit's shards out over the new group (collective; phalanx.sharding.reshard)."""
        shard = sharded_by(self.optimizer)
        if shard is not None:
            self._moved = reshard(shard, self.model, self.optimizer, self.training.strategy, group.current(), snap)

    def _restore(self, snap: dict, joining: bool = False) -> None:
        if sharded_by(self.optimizer) is not None:  # its model and optimizer are shards: _reshard lays them out
            snap = {**snap, "model": None, "optimizer": None}
        self.training.restore(snap, joining=joining)
        for k, v in snap["elastic_extra"].items():
            self.extra[k].load_state_dict(copy.deepcopy(v))
        self.resize.load_state_dict(snap["elastic_resize"])
        clock = self._clock()
        if clock is not None:
            clock.step, clock.pending = int(snap["elastic_step"]), False

    def _resplit(self, before: int) -> None:
        """The rest of the epoch, re-split over the new group; ``before``: the world the live state was built for."""
        sampler = getattr(self.loader, "sampler", None)
        if sampler is not None and hasattr(sampler, "world_size"):
            sampler.rank, sampler.world_size = group.rank(), group.world_size()
        self.resize.resized(self.loader, before=before, after=group.world_size())
        strategy = strategy_of(self.optimizer)
        if isinstance(strategy, Regroupable):
            strategy.regroup()

    # -- a loop kept at module level: `for epoch in state.epochs(n): with state: ...` --------------------------
    def epochs(self, epochs: int) -> Iterator[int]:
        """The epochs to train, for a loop kept at module level; re-entered after a membership change.

        Replace ``for epoch in range(epochs):`` by ``for epoch in state.epochs(epochs):`` and put the
        epoch's body under ``with state:``. A lost peer or an admitted joiner ends that block; the
        group is rebuilt, every worker rolls back to the newest commit they all hold, and the loop
        goes on from the commit's epoch, mid-epoch (the loader keeps its position). Outside
        ``phalanx run --elastic`` this is ``range(epochs)``, and ``with state:`` does nothing.

        Example:
            >>> import torch, phalanx as px
            >>> net = torch.nn.Linear(2, 1)
            >>> net, opt = px.wrap(net, torch.optim.SGD(net.parameters(), lr=0.1))
            >>> state = px.elastic.State(net, opt)
            >>> for epoch in state.epochs(2):
            ...     with state:
            ...         opt.zero_grad(); net(torch.ones(1, 2)).sum().backward(); opt.step()
            >>> state.step
            2
        """
        return _epochs(self, epochs)

    def __enter__(self) -> "State":
        return self

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> bool:
        if exc is None or not self._in_epochs:
            return False  # outside `for epoch in state.epochs(n)` nothing would re-enter the loop: let it end
        return _caught(self, exc)  # True: the epoch ends here; epochs() regroups and resumes at the commit

    def _note(self, plan: dict, before: int, started: float, *, redone: int, cause: str,
              redone_s: float = 0.0) -> None:
        """One history entry per change (who left, who joined, at which step, its cost), one line on rank 0."""
        seconds = time.monotonic() - started
        self.history.append({"generation": plan["generation"], "world_size": group.world_size(),
                             "was": before, "left": plan["left"], "joined": plan["joined"],
                             "step": self.step, "redone_steps": redone, "redone_seconds": round(redone_s, 3),
                             "time": time.time(), "seconds": round(seconds, 3), "cause": cause[:200],
                             **self._moved})
        self._moved = {}
        if group.rank() == 0:
            print(f"phalanx: elastic: generation {plan['generation']}: {before} -> {group.world_size()} workers "
                  f"(left: {', '.join(plan['left']) or '-'}; joined: {', '.join(plan['joined']) or '-'}); "
                  f"resuming from the commit at step {self.step}: {redone} finished step(s) to redo, "
                  f"{redone_s:.2f}s of work since that commit lost; regrouped in {seconds:.2f}s",
                  file=sys.stderr, flush=True)  # finished steps and lost seconds differ: a step in flight is lost too


class _Resize(BaseException):
    """Raised at a commit point where joiners are admitted: the training function is re-entered.

    A BaseException, as KeyboardInterrupt is: it is control flow out of ``opt.step()``, and a
    user's ``except Exception:`` around the step must not swallow it.
    """

    def __init__(self, joiners: list[str]) -> None:
        super().__init__(f"admitting {joiners}")
        self.joiners = joiners


class _Leave(BaseException):
    """Raised at a commit point where workers leave gracefully: the others regroup at that commit."""

    def __init__(self, leavers: list[str]) -> None:
        super().__init__(f"{', '.join(leavers)} leaving")
        self.leavers = leavers


def attach(g: group.Group) -> None:
    """``px.init()``: take this worker's place in an elastic job, and supervise training loops in it.

    Under ``phalanx run --elastic`` the group gets :class:`State` as its supervisor
    (:attr:`phalanx.group.group.Group.supervisor`), which ``Trainer.fit(elastic=...)`` calls; a
    joiner waits here for its place (:func:`phalanx.elastic.worker.place`). Elsewhere it does nothing.
    """
    place(g)
    if g.elastic:
        g.supervisor = State


def is_peer_failure(err: BaseException) -> bool:
    """A failure a rebuilt group can survive: a peer died or stopped answering. Told by type, never by message.

    Every collective and store wait raises :class:`~phalanx.WorkerLostError` through
    :func:`phalanx.group.collectives.guarded`; torch's own distributed errors count too, for a collective
    a user's code ran outside phalanx.
    """
    return isinstance(err, (WorkerLostError, dist.DistBackendError, dist.DistNetworkError, dist.DistStoreError))


# -- re-entering the training after a membership change: one machinery for both forms ------------------------------

def _begin(state: State) -> bool:
    """Before the first attempt: a joiner waits to be admitted; the start is a commit every worker holds.

    False when a joiner arrives after training ended (nothing to do).
    """
    if state.elastic and state.worker.joining and not state.join():
        return False
    if not state.commits:
        state._commit_together()
    return True


def _caught(state: State, err: BaseException) -> bool:
    """Note what ended an attempt, to act on outside the except block; False: not ours, re-raise it."""
    if isinstance(err, _Resize):
        state._pending = ("joiners", err.joiners)
        return True
    if isinstance(err, _Leave):
        state._pending = ("failure", f"worker(s) {', '.join(err.leavers)} left (preempted)", time.time())
        return True
    if not isinstance(err, Exception) or not state.elastic or not is_peer_failure(err):
        return False
    if not state.worker.host_alive():
        state.worker.lost_host()
    state._pending = ("failure", f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}",
                      time.time())
    return True


def _change(state: State) -> None:
    """Grow with the admitted joiners, or regroup after a loss and roll back; again if a peer is lost meanwhile.

    Runs outside the except block that caught the failure: a live exception keeps the dead group's
    tensors (and the collectives other ranks are blocked in) alive. A peer lost while the group is
    being rebuilt (rank 0 killed inside the commit or the regroup) is one more failure of the same
    kind: the survivors regroup again and roll back to the newest commit they all hold.
    """
    while state._pending is not None:
        pending, state._pending = state._pending, None
        try:
            if pending[0] == "joiners":
                state.grow(pending[1])
            else:
                state.recover(pending[1], pending[2])
        except QuorumError as err:
            print(f"phalanx: elastic: worker {state.worker.me}: {err}; stopping", file=sys.stderr, flush=True)
            raise SystemExit(1) from None
        except Exception as err:  # noqa: BLE001 - a lost peer is noted by _caught; anything else is raised
            if not _caught(state, err):
                if not state.worker.host_alive():
                    state.worker.lost_host()
                raise


def _end(state: State) -> None:
    for handle in state._handles:
        handle.remove()
    state._handles = []
    if state.elastic:
        state.worker.finished()


def run(fn: F) -> F:
    """Decorate the training function ``fn(state, ...)``: it is re-entered after every membership change.

    Start your loops from the state (``for epoch in range(state.epoch, epochs)``): after a
    rollback the loader resumes mid-epoch where the commit left it. To keep the loop at
    module level instead, see :meth:`State.epochs`.
    """
    @functools.wraps(fn)
    def wrapper(state: State, *args: Any, **kwargs: Any) -> Any:
        if not isinstance(state, State):
            raise ConfigError(usage(f"{fn.__name__}({type(state).__name__}, ...)",
                                    "a px.elastic.State as the first argument",
                                    "Build state = px.elastic.State(model, opt, loader) and call "
                                    f"{fn.__name__}(state)."))
        if not _begin(state):
            return None  # training ended before we got in: nothing to do
        while True:
            try:
                result = fn(state, *args, **kwargs)
            except BaseException as err:  # noqa: BLE001 - _caught keeps a lost peer and a resize; the rest is raised
                if not _caught(state, err):
                    raise
            else:
                _end(state)
                return result
            _change(state)
    return wrapper  # type: ignore[return-value]


def _epochs(state: State, epochs: int) -> Iterator[int]:
    if not _begin(state):
        return  # training ended before we got in
    state._in_epochs = True
    try:
        epoch = state.epoch
        while epoch < epochs:
            yield epoch
            if state._pending is not None:  # `with state:` ended the epoch early: regroup, resume at the commit
                _change(state)
                epoch = state.epoch
            else:
                epoch += 1
    finally:
        state._in_epochs = False
    _end(state)
