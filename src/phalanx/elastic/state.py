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
    >>> net = torch.nn.Linear(2, 1); opt = torch.optim.SGD(net.parameters(), lr=0.1)
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
import sys
import time
from typing import Any, Callable, TypeVar

import torch
import torch.distributed as dist

from .. import group
from ..comm import broadcast_object
from ..errors import ConfigError, WorkerLostError, usage
from ..wrap import strategy_of
from .membership import QuorumError
from .resize import ResizePolicy, check_policy
from .worker import ElasticWorker

from ..state import TrainingState, shared

DEFAULT_COMMIT_EVERY = 10
KEEP = 2  # commits held; survivors roll back to the newest one they all hold
F = TypeVar("F", bound=Callable[..., Any])


class State:
    """What a worker rolls back to: a :class:`TrainingState` captured in memory every ``commit_every`` steps.

    Args:
        model, optimizer, loader, scheduler: the objects to capture (the optimizer is required).
        commit_every: commit after every this many optimizer steps (counted by a step hook),
            at the strategy's next sync point; None commits only when you call :meth:`commit`.
        extra: more objects with ``state_dict``/``load_state_dict`` to roll back with the rest
            (their state is deep-copied at every commit).
        resize: what a membership change keeps: ``px.elastic.KeepWorkerBatch()`` (default: the
            global batch follows the world size) or ``px.elastic.KeepGlobalBatch()`` (the
            per-worker batch is re-split); see :mod:`phalanx.elastic.resize`.
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None, loader: Any = None,
                 scheduler: Any = None, *, commit_every: int | None = DEFAULT_COMMIT_EVERY,
                 extra: dict[str, Any] | None = None, scaler: Any = None,
                 resize: ResizePolicy | None = None) -> None:
        if commit_every is not None and (isinstance(commit_every, bool) or not isinstance(commit_every, int)
                                         or commit_every < 1):
            raise ConfigError(usage(f"commit_every={commit_every!r}", "an integer >= 1 or None",
                                    "Pass e.g. commit_every=10 (steps between in-memory commits)."))
        self.model, self.optimizer, self.loader = model, optimizer, loader
        self.training = TrainingState(model, optimizer, loader=loader, scheduler=scheduler, scaler=scaler)
        self.extra = dict(extra or {})
        self.resize = check_policy(resize)
        self.commit_every = commit_every
        self.step = 0  # optimizer steps taken, rolled back with the commit
        self.commits: dict[int, dict] = {}
        self.history: list[dict] = []  # one entry per membership change
        self._checked = False
        self.worker = ElasticWorker.from_environ()
        if optimizer is not None:
            optimizer.register_step_post_hook(lambda *_: self._after_step())

    @property
    def elastic(self) -> bool:
        """True under ``phalanx run --elastic``; otherwise commits are skipped."""
        return self.worker is not None

    @property
    def epoch(self) -> int:
        """The epoch the loader is in (restored with the commit): start your epoch loop here."""
        sampler = getattr(self.loader, "sampler", None)
        return int(getattr(sampler, "epoch", 0))

    def _after_step(self) -> None:
        self.step += 1
        if self.commit_every is None or not self.elastic:
            return
        last = max(self.commits, default=0)
        strategy = strategy_of(self.optimizer)
        # Between sync points LocalSGD/DiLoCo replicas differ and may be steps apart; commit only where
        # every worker stands at the same step with the same model.
        if self.step - last >= self.commit_every and (strategy is None or strategy.replicas_agree(strategy.steps)):
            self._commit_together()
            joiners = self.worker.admit(self.step)
            if joiners:
                raise _Resize(joiners)  # out of opt.step() and the training function; run() re-enters it

    def commit(self) -> None:
        """Capture this worker's state in memory (no collective); keeps the newest two."""
        if not self._checked:
            self._check()
        if not self.elastic:
            return
        snap = self.training.capture()
        snap["elastic_step"] = self.step
        snap["elastic_extra"] = {k: copy.deepcopy(v.state_dict()) for k, v in self.extra.items()}
        # the world the commit was taken in (its lr is that world's) and when: a rollback's cost in seconds
        snap["elastic_world_size"], snap["elastic_time"] = group.world_size(), time.time()
        snap["elastic_resize"] = self.resize.state_dict()
        self.commits[self.step] = snap
        for old in sorted(self.commits)[:-KEEP]:
            del self.commits[old]

    def _commit_together(self) -> None:
        """A commit every member takes at the same step. An async PS settles around it."""
        strategy = strategy_of(self.optimizer) if self.elastic else None
        if strategy is not None:
            strategy.commit_point()  # e.g. every worker's pushes up to this step are on the servers before the snapshot
        self.commit()
        if strategy is not None:
            strategy.commit_point()  # and no one's next push lands before every worker took it

    def _check(self) -> None:
        self._checked = True
        if self.optimizer is None:
            raise ConfigError(usage("px.elastic.State without an optimizer",
                                    "State(model, optimizer, loader, ...)",
                                    "Pass the optimizer: a rollback without its state (momentum, Adam moments) "
                                    "would not continue the run you had."))
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
        backend = dist.get_backend() if dist.is_initialized() else "gloo"
        plan = self.worker.regroup(sorted(self.commits), backend=backend)
        snap = self.commits[plan["step"]]
        for newer in [s for s in self.commits if s > plan["step"]]:
            del self.commits[newer]
        lost_steps = self.step - plan["step"]
        self._restore(snap)
        if plan["joined"]:  # spares/joiners the quorum admitted wait in join() for rank 0's commit
            self._send_state()
        self._resplit(snap["elastic_world_size"])
        self._note(plan, before, started, redone=lost_steps, cause=failure,
                   redone_s=max(0.0, failed_at - snap["elastic_time"]))


    def grow(self, joiners: list[str]) -> None:
        """Members at a commit point: rebuild with the joiners and send them rank 0's state (collective)."""
        started, before = time.monotonic(), group.world_size()
        plan = self.worker.grow(joiners, backend=dist.get_backend() if dist.is_initialized() else "gloo")
        self._send_state()
        self._resplit(before)
        self._note(plan, before, started, redone=0, cause="joined")

    def join(self) -> bool:
        """A joiner: wait for admission, then take rank 0's state; False if training had ended."""
        started = time.monotonic()
        plan = self.worker.wait_for_admission()
        if plan is None:
            return False
        snap = self._send_state()
        # rank 0's model, optimizer, shared strategy state and data position; not its own RNG streams or
        # compressor residuals (its error feedback would be counted twice): a joiner starts those fresh.
        self._restore(shared(snap), joining=True)  # a joiner never puts the async PS back
        self._resplit(snap["elastic_world_size"])
        self.commits = {}
        self.commit()  # its own state as it now stands (its residuals and RNG, not rank 0's)
        self._note(plan, 0, started, redone=0, cause="joined")
        return True

    def _send_state(self) -> dict:
        """Rank 0's newest commit on every worker (a broadcast of its bytes; loaded weights-only)."""
        mine = self.commits[max(self.commits)] if group.rank() == 0 else None
        return broadcast_object(mine, 0, "newest commit")

    def _restore(self, snap: dict, joining: bool = False) -> None:
        self.training.restore(snap, joining=joining)
        for k, v in snap["elastic_extra"].items():
            self.extra[k].load_state_dict(copy.deepcopy(v))
        self.resize.load_state_dict(snap["elastic_resize"])
        self.step = snap["elastic_step"]

    def _resplit(self, before: int) -> None:
        """The rest of the epoch, re-split over the new group; ``before``: the world the live state was built for."""
        sampler = getattr(self.loader, "sampler", None)
        if sampler is not None and hasattr(sampler, "world_size"):
            sampler.rank, sampler.world_size = group.rank(), group.world_size()
        self.resize.resized(self.loader, before=before, after=group.world_size())
        strategy = strategy_of(self.optimizer)
        if strategy is not None:
            strategy.regroup()

    def _note(self, plan: dict, before: int, started: float, *, redone: int, cause: str,
              redone_s: float = 0.0) -> None:
        """One history entry per change (who left, who joined, at which step, its cost), one line on rank 0."""
        seconds = time.monotonic() - started
        self.history.append({"generation": plan["generation"], "world_size": group.world_size(),
                             "was": before, "left": plan["left"], "joined": plan["joined"],
                             "step": self.step, "redone_steps": redone, "redone_seconds": round(redone_s, 3),
                             "time": time.time(), "seconds": round(seconds, 3), "cause": cause[:200]})
        if group.rank() == 0:
            print(f"phalanx: elastic: generation {plan['generation']}: {before} -> {group.world_size()} workers "
                  f"(left: {', '.join(plan['left']) or '-'}; joined: {', '.join(plan['joined']) or '-'}); "
                  f"at step {self.step}, redoing {redone} step(s) ({redone_s:.2f}s of work); regrouped in "
                  f"{seconds:.2f}s", file=sys.stderr, flush=True)


class _Resize(BaseException):
    """Raised at a commit point where joiners are admitted: the training function is re-entered.

    A BaseException, as KeyboardInterrupt is: it is control flow out of ``opt.step()``, and a
    user's ``except Exception:`` around the step must not swallow it.
    """

    def __init__(self, joiners: list[str]) -> None:
        super().__init__(f"admitting {joiners}")
        self.joiners = joiners


def is_peer_failure(err: BaseException) -> bool:
    """A failure a rebuilt group can survive: a peer died or stopped answering. Told by type, never by message.

    Every collective and store wait raises :class:`~phalanx.WorkerLostError` through
    :func:`phalanx.comm.guarded`; torch's own distributed errors count too, for a collective
    a user's code ran outside phalanx.
    """
    return isinstance(err, (WorkerLostError, dist.DistBackendError, dist.DistNetworkError, dist.DistStoreError))


def run(fn: F) -> F:
    """Decorate the training function ``fn(state, ...)``: it is re-entered after every membership change.

    Start your loops from the state (``for epoch in range(state.epoch, epochs)``): after a
    rollback the loader resumes mid-epoch where the commit left it.
    """
    @functools.wraps(fn)
    def wrapper(state: State, *args: Any, **kwargs: Any) -> Any:
        if not isinstance(state, State):
            raise ConfigError(usage(f"{fn.__name__}({type(state).__name__}, ...)",
                                    "a px.elastic.State as the first argument",
                                    "Build state = px.elastic.State(model, opt, loader) and call "
                                    f"{fn.__name__}(state)."))
        if state.elastic and state.worker.joining and not state.join():
            return None  # training ended before we got in: nothing to do
        if not state.commits:
            state._commit_together()  # the start is always a commit every worker holds
        while True:
            failure, joiners, failed_at = None, None, 0.0
            try:
                result = fn(state, *args, **kwargs)
            except _Resize as resize:
                joiners = resize.joiners
            except Exception as err:  # noqa: BLE001 - sorted just below
                if not state.elastic or not is_peer_failure(err):
                    raise
                if not state.worker.host_alive():
                    state.worker.lost_host()
                failure = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
                failed_at = time.time()
            if failure is None and joiners is None:
                state.worker.finished() if state.elastic else None
                return result
            # Outside the except block: a live exception keeps the dead group's tensors (and the
            # collectives other ranks are blocked in) alive.
            try:
                if joiners is not None:
                    state.grow(joiners)
                    continue
                state.recover(failure, failed_at)
            except QuorumError as err:
                print(f"phalanx: elastic: worker {state.worker.me}: {err}; stopping", file=sys.stderr, flush=True)
                raise SystemExit(1) from None
            except Exception:
                if not state.worker.host_alive():
                    state.worker.lost_host()
                raise
    return wrapper  # type: ignore[return-value]
