"""``px.elastic.State``: the snapshot ring, a worker's training state committed in memory.

A commit is this worker's training state captured in memory (model, optimizer,
strategy, data position, RNG, step): no collective, no disk. The ring keeps the
newest two; what happens after a membership change is :mod:`phalanx.elastic.recovery`
(roll back to the newest commit every survivor holds, reshard, joiners take rank 0's
state), and re-entering the training is :mod:`phalanx.elastic.run`.

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
import os
import sys
import time
from typing import Any

import torch

from ..group import group
from ..train.trainer import SUPERVISOR
from ..checkpoint import save_checkpoint
from ..errors import ConfigError, usage
from ..sharding.reshard import RowState, local_parts
from ..sharding.layout import hsdp, sharded_by
from ..wrap import strategy_of
from ..group.spans import span
from ..step.preempt import HANDED_OVER, PREEMPTION
from ..strategies.allreduce import REBUILT
from ..strategies.compression import FP16
from ..strategies.diloco import DiLoCo
from ..strategies.quantize import Gathered
from ..step.protocols import replicas_agree
from .recovery import Recovery
from .resize import ResizePolicy, check_policy
from .rule import CommitPoint
from .run import JoinersAdmitted, Reentry, WorkersLeaving
from .worker import ElasticWorker, place

from ..checkpoint.training_state import TrainingState

DEFAULT_COMMIT_EVERY = 10
KEEP = 2  # commits held; survivors roll back to the newest one they all hold


class State(Recovery, Reentry):
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

    A commit is taken between two steps: where a loader with a commit point of its own
    (``before_batch``: ``px.shard``'s, ``px.stream.StreamLoader``) is about to hand out the next
    batch (the step before is over on every rank, and the loader's position still points at
    that batch), or, with any other loader, right after ``optimizer.step()`` and at every
    :meth:`commit` the loop calls.

    A membership change (a graceful leave, an admission) is decided only at a commit point the
    loop shows: that loader's iteration, or, with any other loader, the loop's own
    ``state.commit()``. It ends the attempt with a :class:`~phalanx.elastic.MembershipChange`
    (a ``BaseException``) that ``@px.elastic.run`` handles; ``optimizer.step()`` never raises one.
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
        self._decides_at_commit = False  # True: a loader without before_batch, the user's state.commit() decides
        self._attempting = False  # inside @px.elastic.run's call of the training function, or `with state:`
        self._taking = False  # inside _commit_together: commit() captures only
        self._loop_commits = False  # the loop called state.commit() inside @px.elastic.run: it decides changes
        self._handles: list[Any] = []
        self._moved: dict[str, int] = {}  # bytes of sharded state the last reshard received, for the history
        self.worker = ElasticWorker.of(group.current())
        if self.worker is not None:
            self.worker.beat()
        if self.elastic:
            refuse_unreshardable(optimizer)
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

    def _clock(self) -> Any:
        return getattr(self.training.strategy, "clock", None)

    def _hook_commit_point(self) -> None:
        before_batch = getattr(self.loader, "before_batch", None)
        # Where a membership change may be decided: a point the user's loop shows, never inside opt.step().
        # A loader with a commit point of its own (px.shard's, phalanx.stream's) decides between two steps, before
        # its position moves past the next batch; any other loader, or none, decides at the loop's state.commit().
        self._decides_at_commit = not callable(before_batch)
        if callable(before_batch):
            self._handles.append(before_batch(self.at_commit_point))
        elif self.optimizer is not None:  # the due commit right after the step (a snapshot: it raises nothing)
            self._handles.append(self.optimizer.register_step_post_hook(lambda *_: self._after_step()))

    def at_commit_point(self) -> None:
        """The loader's iteration boundary (its ``before_batch`` hook, before it hands out a batch): commit when
        one is due, then who leaves and who joins is decided here (:meth:`_decide`: may raise a
        :class:`~phalanx.elastic.MembershipChange` out of the loop's ``for batch in loader``)."""
        self._commit_point(asked=False)

    def _after_step(self) -> None:
        """A loader without ``before_batch``, right after ``optimizer.step()``: the commit when one is due, a snapshot
        only. Nothing is decided or raised inside the user's ``opt.step()``: joiners and leavers wait for the loop's
        next ``state.commit()``, a call the user wrote (:meth:`commit`)."""
        clock = self._clock()
        if not self.elastic or clock is None:
            return
        signal = getattr(PREEMPTION.of(group.current()).value, "signal", None)
        if signal is not None and not self._leaving:  # a notice only (a store key): the leave is decided at commit()
            self._leaving = True
            self.worker.membership.ask_to_leave()
            print(f"phalanx: elastic: worker {self.worker.me} was sent signal {signal}; with a loader without a "
                  "commit point of its own it leaves the group at the next commit (its loop's state.commit(), or, "
                  "in a loop that calls none, the next commit taken after opt.step())", file=sys.stderr, flush=True)
        if self.commit_every is None:
            return
        clock.settle()  # a step this rank's GradScaler skipped is closed: every rank now counts the same
        if self._due(clock.step) and self._agree(clock.step):
            self._commit_together()
            # A loop that never calls state.commit() has no point where a change could be raised, so a worker
            # asked to leave ends its own process here, at a commit every member holds (nothing is thrown out
            # of opt.step(): the process exits, as preemption asks). The others meet it gone at their next
            # exchange and roll back to this very commit: nothing is redone.
            step = clock.step
            if self._leaving and not self._loop_commits and self.worker.me in self.worker.membership.leavers(step):
                self.worker.leave(step)

    def _commit_point(self, *, asked: bool) -> None:
        """A commit point the user's loop shows: the loader's iteration (``asked`` False: a commit when one is due)
        or the user's ``state.commit()`` with any other loader (``asked``: a commit now). After a commit every
        member took together, who leaves and who joins is decided (:meth:`_decide`)."""
        clock = self._clock()
        if (self.commit_every is None and not asked) or not self.elastic or clock is None:
            return
        clock.settle()  # a step this rank's GradScaler skipped is closed: every rank now counts the same
        step = clock.step
        preemption = PREEMPTION.of(group.current()).value
        if preemption is not None and preemption.signal is not None and not self._leaving:
            self._leaving = True  # SIGTERM to this worker (a node drained): leave at the next commit
            self.worker.membership.ask_to_leave()
        # Between sync points LocalSGD/DiLoCo replicas differ and may be steps apart; a change is decided only
        # where every worker stands at the same step with the same model.
        if not self._agree(step):
            if asked:
                self._commit_together(capture_only=True)  # the commit asked for, of this replica; nothing decided
            return
        if asked or self._due(step):
            self._commit_together()
            self._decide(step)

    def _due(self, step: int) -> bool:
        return self.commit_every is not None and step - max(self.commits, default=0) >= self.commit_every

    def _agree(self, step: int) -> bool:
        strategy = self.training.strategy
        return strategy is None or replicas_agree(strategy, step)

    def _decide(self, step: int) -> None:
        """At the commit of ``step``, taken by every member: who leaves, then who joins (the first member there
        decides for all, :mod:`phalanx.elastic.membership`). A change ends the attempt with its public type."""
        leavers = self.worker.membership.leavers(step)
        if self.worker.me in leavers:
            self.worker.leave(step)  # says goodbye and ends this process with PREEMPTED_EXIT
        if leavers:
            raise WorkersLeaving(leavers)  # the others regroup at this very commit: nothing is redone
        joiners = self.worker.membership.admit(step, self.worker.pending_joiners)
        if joiners:
            raise JoinersAdmitted(joiners)  # out of the loop and the training function; the group grows outside it

    def commit(self) -> None:
        """Capture this worker's state in memory; keeps the newest two.

        With a loader without a commit point of its own (a ``DataLoader``, your own iterator) this call is the
        loop's commit point, as Horovod's ``state.commit()`` is: inside ``@px.elastic.run`` (or ``with state:``
        under ``state.epochs``) every worker calls it at the same step, and there a graceful leave or an admission
        may end the attempt with a :class:`~phalanx.elastic.MembershipChange`, which ``@px.elastic.run`` handles.
        Nothing is raised from ``optimizer.step()``. With a ``px.shard`` or a ``px.stream`` loader that point is
        the loader's iteration and this call only captures (no collective); so does it outside ``@px.elastic.run``.

        Example:
            >>> import torch, phalanx as px
            >>> net = torch.nn.Linear(2, 1)
            >>> net, opt = px.wrap(net, torch.optim.SGD(net.parameters(), lr=0.1))
            >>> state = px.elastic.State(net, opt)
            >>> @px.elastic.run
            ... def train(state):
            ...     for x in [torch.ones(1, 2)] * 2:     # any iterable
            ...         opt.zero_grad(); net(x).sum().backward(); opt.step()
            ...         state.commit()                   # where this loop lets the group change
            ...     return state.step
            >>> train(state)
            2
        """
        if not self._checked:
            self._check()
        if not self.elastic:
            return
        if self._decides_at_commit and self._attempting and not self._taking:
            self._loop_commits = True  # this loop shows its commit points: changes are decided at them
            self._commit_point(asked=True)  # the loop's own commit point: commit together, then decide
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
            strategy = self.training.strategy
            if isinstance(strategy, RowState):  # the rule's own rows (DiLoCo's anchor): a reshard moves them too
                snap["rows"] = {k: [t.detach().clone() for t in ts] for k, ts in strategy.row_state().items()}
        self.commits[step] = snap
        for old in sorted(self.commits)[:-KEEP]:
            del self.commits[old]

    def _commit_together(self, capture_only: bool = False) -> None:
        """A commit every member takes at the same step. An async PS settles around it (``capture_only``: not, a
        replica's own commit between sync points)."""
        strategy = self.training.strategy if self.elastic and not capture_only else None  # px.wrap's, or Keras's
        if isinstance(strategy, CommitPoint):
            strategy.commit_point()  # e.g. every worker's pushes up to this step are on the servers before the snapshot
        self._taking = True  # commit() below captures (a subclass may extend it); it is not the user's commit point
        try:
            with span("phalanx/commit"):  # the timeline (phalanx.step.profiling)
                self.commit()
                if self.checkpoint is not None and self.elastic and not capture_only:
                    save_checkpoint(self.checkpoint, self.model, self.optimizer, step=self.step)
        finally:
            self._taking = False
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
        # a torch optimizer must hold the model's parameters; a Keras run's optimizer state (px.keras) holds variables
        groups = self.optimizer.param_groups if isinstance(self.optimizer, torch.optim.Optimizer) else None
        ours = {id(p) for g in groups or [] for p in g["params"]}
        missing = [n for n, p in self.model.named_parameters() if p.requires_grad and id(p) not in ours] \
            if groups is not None else []
        if missing:
            raise ConfigError(usage(f"an optimizer that does not hold {len(missing)} trainable parameter(s) of "
                                    f"the model (e.g. {missing[0]})", "the optimizer of this model",
                                    "Pass the optimizer built from model.parameters()."))
        self.resize.start(self.loader, group.world_size())

    def _restore(self, snap: dict, joining: bool = False) -> None:
        if sharded_by(self.optimizer) is not None:  # its model and optimizer are shards: _reshard lays them out
            snap = {**snap, "model": None, "optimizer": None}
        self.training.restore(snap, joining=joining)
        for k, v in snap["elastic_extra"].items():
            self.extra[k].load_state_dict(copy.deepcopy(v))
        self.resize.load_state_dict(snap["elastic_resize"])
        clock = self._clock()
        if clock is not None:
            clock.restore(snap["elastic_step"])


def refuse_unreshardable(optimizer: torch.optim.Optimizer | None) -> None:
    """Refuse, before training, a sharded model whose rule keeps per-rank state a regroup cannot re-shard.

    A regroup re-shards the model, the optimizer and the rule's own rows (:class:`RowState`: DiLoCo's
    anchor and outer momentum, EASGD's centre, StreamingDiLoCo's anchors, momentum and exchanges in flight; its
    ``row_state()`` refuses what it cannot lay out by rows, an eager stand-in). DiLoCo's error-feedback residuals
    (``px.SparseLoCo()``, ``px.Quantize``) start empty at a regroup; a compressor whose shared state is laid out by
    the old shards (PowerSGD) is refused here rather than restored wrong after the first loss.

    Example:
        >>> import torch; refuse_unreshardable(torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1))
    """
    layout = sharded_by(optimizer)
    strategy = strategy_of(optimizer) if optimizer is not None else None
    if layout is None or strategy is None or hsdp(strategy):
        return
    compression = getattr(strategy, "compression", None)
    # DiLoCo's residuals (SparseLoCo, Quantize) start empty at a regroup (OuterStep.load_row_state); a compressor
    # with shared state laid out by the old shards (PowerSGD's Q) is not moved
    dropped = isinstance(strategy, DiLoCo) and isinstance(compression, (Gathered, FP16))
    if not isinstance(strategy, RowState) or (compression is not None and not dropped):
        raise ConfigError(usage(f"shard=FullyShard(group_size={layout.group_size}) with {strategy!r} under "
                                "`phalanx run --elastic`", "px.AllReduce() (HSDP), or a periodic rule without a "
                                "compressor (LocalSGD, DiLoCo, EASGD, StreamingDiLoCo), or DiLoCo with "
                                "px.SparseLoCo(), px.Quantize or px.FP16(): a regroup re-shards their state onto the "
                                "survivors, not PowerSGD's", "Use one of those, drop --elastic, or drop shard=."))
    strategy.row_state()  # a rule refuses here, in one line, a part of its state it cannot lay out by rows


def attach(g: group.Group) -> None:
    """``px.init()``: take this worker's place in an elastic job, and supervise training loops in it.

    Under ``phalanx run --elastic`` the group gets :class:`State` as its supervisor
    (:data:`phalanx.train.trainer.SUPERVISOR`), which ``Trainer.fit(elastic=...)`` calls; a
    joiner waits here for its place (:func:`phalanx.elastic.worker.place`). Elsewhere it does nothing.
    """
    place(g)
    if g.elastic:
        SUPERVISOR.of(g).value = State
        # the facts the core reads in its own records, rather than asking whether membership can change
        HANDED_OVER.of(g).value = "phalanx.elastic"  # a signalled worker leaves at the next commit
        REBUILT.of(g).value = "phalanx.elastic"  # joiners attach alone; gradient hooks follow the rebuilt group
