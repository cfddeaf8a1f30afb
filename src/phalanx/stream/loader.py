"""Per-worker batches from a live stream, every event trained exactly once.

The main worker claims events from the source (in stream order, through the consumer group), sets aside the ones
that cannot be decoded, and cuts the good ones into steps and each step into ``world_size`` contiguous parts: a
step's global batch is exactly the one a single process would take with ``world_size * batch_size``. With a
backlog, one broadcast plans up to ``ahead`` steps (:mod:`phalanx.stream.plan`), claimed a step's worth per
read; the main worker decides the next plan on a background thread while the current one trains, and broadcasts
it one step early when it is ready, so every other worker fetches and decodes its own parts on a background
thread before it needs them. Small reads give the GIL back to the training thread often. Uneven parts set
:func:`phalanx.step.clock.set_batch_weight`, so the averaged gradient equals one process's on the same events.

The loader's position (the last entry id a *trained* step covered, never a
planned one) is its whole state: ``state_dict()`` is plain strings and ints
that a checkpoint carries and that do not depend on the number of workers.
Entries are acknowledged to the broker only after a commit covers them: the
position a ``state_dict()`` returned is acknowledged by the planner before its
next read (or after the last step), once the checkpoint that asked for it was
written, and by :meth:`StreamLoader.close`. Restoring a state discards the planned
steps and rewinds the group there: events trained after the last commit are trained
again, once.

Example (``source`` is a :class:`phalanx.stream.RedisStream`)::

    loader = px.stream.StreamLoader(source, batch_size=32, policy=px.stream.Deadline(0.5),
                                    stop=px.stream.Stop(idle_s=5))
    for x, y in loader:
        opt.zero_grad(); F.cross_entropy(model(x), y).backward(); opt.step()
        if loader.steps % 50 == 0:
            px.save_checkpoint("ckpt.pt", model, opt, loader=loader, step=loader.steps)
    loader.close()
"""
from __future__ import annotations

import collections
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Iterator

import torch
import torch.distributed as dist

from ..group import group
from ..group.guard import guarded
from ..data.hooks import BeforeBatch
from ..step.clock import set_batch_weight
from ..errors import ConfigError, usage
from .plan import HEAD, PER_RANK, END, ERROR, STEP, WAIT, Fetched, Plan, pack_plans, unpack_plans, split
from .decoding import DEAD, Decoder, fetch_parts
from .policy import Stop, WaitFull
from .source import END_FIELD, START, StreamError, StreamSource

_KEEPALIVE_S = 1.0  # while waiting for events, tell the other workers at least this often (no collective timeout)
_CHECK_EVERY_S = 1.0  # XINFO (retention and lag) on a timer, not per step; always at the start of a run


class StreamLoader(BeforeBatch):
    """An iterable of this worker's batches from ``source``; see the module doc.

    Args:
        source: a :class:`phalanx.stream.source.StreamSource` such as ``RedisStream``.
        batch_size: events per worker per step (a full global batch is ``world_size * batch_size``).
        policy: :class:`WaitFull` (default) or :class:`Deadline`.
        stop: when the run ends besides an end-of-stream marker; :class:`Stop`.
        block_s: how long one read from the broker may wait.
        ahead: at most this many steps planned per broadcast when a backlog allows (fewer when live).

    Its commit point (:meth:`before_batch`, as ``px.shard``'s) runs on every rank at the same plan (the main
    worker's), once per batch handed out: never while the group only waits for events, nor at the end of the stream.

    After each step: ``ids`` (the entry ids this worker trained on), ``steps``,
    ``position`` and :meth:`stats` (events/s, lag, acknowledged position, dead letters).
    """

    def __init__(self, source: StreamSource, batch_size: int, *, policy: Any = None, stop: Stop | None = None,
                 block_s: float = 0.2, ahead: int = 8, rank: int | None = None,
                 world_size: int | None = None) -> None:
        super().__init__()
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ConfigError(usage(f"batch_size={batch_size!r}", "an integer >= 1 (events per worker per step)",
                                    "Pass e.g. batch_size=32."))
        if not (isinstance(block_s, (int, float)) and 0 < block_s <= 30):
            raise ConfigError(usage(f"block_s={block_s!r}", "seconds in (0, 30]", "Pass e.g. block_s=0.2."))
        if isinstance(ahead, bool) or not isinstance(ahead, int) or not 1 <= ahead <= 64:
            raise ConfigError(usage(f"ahead={ahead!r}", "an integer in [1, 64] (steps planned per broadcast)",
                                    "Pass e.g. ahead=8, or ahead=1 to plan one step at a time."))
        self.source, self.batch_size, self.ahead = source, batch_size, ahead
        self.policy, self.stop = policy or WaitFull(), stop or Stop()
        self.block_s = float(block_s)
        self._given = (rank, world_size)  # None: read from the group at each iteration (it may have been rebuilt)
        self.rank = group.rank() if rank is None else rank
        self.world_size = group.world_size() if world_size is None else world_size
        # state (checkpointed)
        self.position: str | None = None  # None: start after what the group acknowledged
        self.offset = -1  # entries up to the position, -1 when unknown
        self.steps = self.events = self.dead = 0
        self.structure = 0  # the fingerprint of the structure every batch has (decoding.Decoder), 0: not fixed
        # progress (not checkpointed)
        self.ids: list[str] = []
        self.lag = -1
        self.batch_weight = 1.0  # this worker's share of the batch last yielded (phalanx.step.clock.set_batch_weight)
        self.acknowledged: str | None = None
        self._commit: tuple[str, int] | None = None  # the position the last state_dict() returned
        self._written: tuple[str, int] | None = None  # the same, once the loop body that took it has run
        self._decoder = Decoder(source.decode)  # the main worker's, for planning (its structure may run ahead)
        self._log: list[tuple[str, Any]] = []  # claimed, decoded (or DEAD), not yet planned (main worker)
        self._planned: collections.deque[Plan] = collections.deque()  # planned, not yet trained (every worker)
        self._prefetch: ThreadPoolExecutor | None = None  # fetches this worker's parts; plans on the main worker
        self._ahead_plan: Future | None = None  # the main worker's next plans, being decided
        self._halt = threading.Event()  # set while a planner nobody will use must give up waiting for events
        self._iteration = 0  # which run of __iter__ is the current one
        self._cursor: tuple[int, str, int] = (0, START, -1)  # how far planning went: steps, position, offset
        self._claimed_to: str | None = None
        self._first_wait, self._ended = None, False  # when the current wait began; the end marker was claimed
        self._added, self._checked = 0, float("-inf")  # entries ever added, at the last XINFO
        self._t0 = self._last_event = time.monotonic()
        self._events0 = 0

    # -- state -----------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The committed position: plain values, the same on every worker, for any world size."""
        if self.position is not None:
            self._commit = (self.position, self.offset)  # acknowledged later, once saved (one atomic assignment)
        return {"position": self.position or "", "offset": self.offset, "steps": self.steps,
                "events": self.events, "dead": self.dead, "structure": self.structure}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.position = str(state["position"]) or None
        self.offset, self.steps = int(state["offset"]), int(state["steps"])
        self.events, self.dead = int(state["events"]), int(state["dead"])
        self.structure = int(state.get("structure", 0))  # (absent from checkpoints written before it existed)
        self._log, self._ended, self._commit, self._written = [], False, None, None
        self._stop_planner()
        self._planned.clear()  # a rollback: steps planned after the restored position are planned again

    def stats(self) -> dict[str, Any]:
        """Progress for the bar and history: events trained, events/s this run, lag, acknowledged position."""
        elapsed = time.monotonic() - self._t0
        return {"events": self.events, "events_per_s": (self.events - self._events0) / elapsed if elapsed else 0.0,
                "lag": self.lag, "acknowledged": self.acknowledged, "dead_letters": self.dead}

    # -- what the Trainer asks of a loader ---------------------------------------------------
    def set_epoch(self, epoch: int) -> None:
        """Nothing to reshuffle: a stream's order is its own. An "epoch" is one run to an end condition."""

    def steps_left(self) -> int | None:
        """Unknown: a live stream has no length."""
        return None

    # -- iteration -------------------------------------------------------------------------
    def __iter__(self) -> Iterator[Any]:
        rank, world_size = self._given
        self.rank = group.rank() if rank is None else rank
        self.world_size = group.world_size() if world_size is None else world_size
        self._t0 = self._last_event = time.monotonic()
        self._events0 = self.events
        self._stop_planner()
        self._planned.clear()  # planned but untrained steps no commit covers: re-planned after the rewind
        self._iteration += 1
        iteration = self._iteration
        if self.rank == 0:
            self._start()
        try:
            while True:
                if not self._planned:
                    self._planned.extend(self._next_plans())
                plan = self._planned.popleft()
                if plan.status == WAIT:
                    continue
                if plan.status == STEP:
                    # Between two steps, at the same plan on every rank, before the position moves past this
                    # one: a commit taken here holds the step before; a change raised here leaves the loop (the
                    # `finally` below stops the planner) and the next iteration re-plans from the restored position.
                    self.run_before_batch()
                # the main worker's view, so every worker's state_dict is the same
                self.position, self.offset, self.dead = plan.position, plan.offset, self.dead + plan.dead
                self.structure = plan.structure or self.structure
                self.lag = plan.lag
                if plan.status == END:
                    return
                if not self._planned and not plan.final and self.world_size > 1:
                    # The next plans now, if the main worker has them ready: the other workers then fetch
                    # their parts while this step trains, instead of waiting for them at the next one.
                    self._planned.extend(self._next_plans(early=True))
                self.ids, batch = self._my_part(plan)
                self.steps, self.events = self.steps + 1, self.events + plan.total
                self.batch_weight = plan.parts[self.rank][2] * self.world_size / plan.total
                set_batch_weight(self.batch_weight)
                yield batch
                # The loop body ran, so a save that took a state_dict() in it is written: the planner may
                # acknowledge it now (not before: it runs while the body does).
                self._written = self._commit
                if self.rank == 0 and self._ahead_plan is None:  # the last planned step (no planner runs)
                    self._acknowledge(quiet=True)
                if plan.final:
                    return
        finally:
            self.batch_weight = 1.0
            set_batch_weight(1.0)
            if iteration == self._iteration:  # a loop left early: no planner may claim on after it. (An abandoned
                self._stop_planner()          # iteration may close late, during the next one: then leave it be.)

    def close(self) -> None:
        """Acknowledge the last committed position and leave nothing pending (call it on every worker)."""
        self._stop_planner()
        if self.rank == 0 and self._commit is not None:
            position, offset = self._commit
            self._acknowledge(final=True)
            self.source.rewind(position, offset if offset >= 0 else None)  # un-claim what no commit covers
        self._planned.clear()
        if self._prefetch is not None:
            self._prefetch.shutdown(wait=True, cancel_futures=True)
            self._prefetch = None

    def _acknowledge(self, quiet: bool = False, final: bool = False) -> None:
        """XACK up to the position a ``state_dict()`` returned, once the save that asked for it is written:
        after the loop body that took it, or (``final``, from :meth:`close`) the last one taken.

        ``quiet`` (between steps) keeps the commit for the next try if the broker does not answer: the next
        claim then fails too, and reports it through the plan every worker hears, not on one worker alone."""
        commit = self._commit if final else self._written  # (read once: the training thread may move it)
        if commit is not None:
            try:
                self.source.acknowledge(commit[0])
            except StreamError:
                if quiet:
                    return
                raise
            self.acknowledged = commit[0]
            if self._written is commit:
                self._written = None

    # -- the main worker's side -----------------------------------------------------------
    def _start(self) -> None:
        position, offset = self.source.rewind(self.position, self.offset if self.offset >= 0 else None)
        self.position, self.offset = position, -1 if offset is None else offset
        self._log, self._claimed_to, self._ended, self._first_wait = [], None, False, None
        self._decoder = Decoder(self.source.decode, self.structure)  # planning starts from the trained state
        self._cursor = (self.steps, position, self.offset)  # where planning stands: steps, position, offset
        self._added, self._checked = self.source.check(position, self.offset if self.offset >= 0 else None), \
            time.monotonic()

    def _plan(self) -> list[Plan]:
        """The main worker's next plans, decided in the background while the previous ones trained."""
        ahead, self._ahead_plan = self._ahead_plan, None
        plans = ahead.result() if ahead is not None else self._decide()
        if plans[-1].status != END and not plans[-1].final:
            self._ahead_plan = self._fetcher().submit(self._decide)
        return plans

    def _stop_planner(self) -> None:
        """Wait for the background planner (bounded by one blocking read): nothing may claim after a rewind."""
        ahead, self._ahead_plan = self._ahead_plan, None
        if ahead is not None:
            self._halt.set()  # a planner waiting for events that may never come (one process, no stop rule)
            try:
                ahead.result()
            except Exception:  # noqa: BLE001 - a failure of plans nobody will use; the caller's error wins
                pass
            finally:
                self._halt.clear()

    def _next_plans(self, early: bool = False) -> list[Plan]:
        """The next planned steps: the main worker decides them, one broadcast tells every worker.

        ``early`` (a step is still at hand): no plans, rather than waiting, when the planner is not done."""
        if self.world_size == 1:
            return self._plan()
        on = group.device() if dist.get_backend() == "nccl" else torch.device("cpu")  # NCCL moves CUDA tensors
        size = 1 + self.ahead * (HEAD + PER_RANK * self.world_size)
        if self.rank == 0:
            try:
                ready = not early or (self._ahead_plan is not None and self._ahead_plan.done())
                plans = self._plan() if ready else []
            except Exception:  # the broker, or the user's decode: the others must not wait for a plan forever
                with guarded("telling the workers the stream failed"):
                    dist.broadcast(pack_plans([Plan(ERROR)], self.world_size, size).to(on), src=0)
                raise
            with guarded("sharing the stream plan"):
                dist.broadcast(pack_plans(plans, self.world_size, size).to(on), src=0)
            return plans
        t = torch.zeros(size, dtype=torch.int64, device=on)
        with guarded("receiving the stream plan"):
            dist.broadcast(t, src=0)
        plans = unpack_plans(t.cpu(), self.world_size)
        if plans and plans[0].status == ERROR:
            raise StreamError(f"the main worker lost the stream {self.source.stream!r} at {self.source.url}; "
                              "its log says why. Training resumes from the last checkpoint.")
        steps = [plan for plan in plans if plan.status == STEP]
        if steps:  # fetch and decode this worker's parts in one background task while it trains
            parts = self._fetcher().submit(fetch_parts, self.source, steps[0].structure, self.rank,
                                           [plan.parts[self.rank] for plan in steps])
            for k, plan in enumerate(steps):
                plan.mine = Fetched(parts, k)
        return plans

    def _decide(self) -> list[Plan]:
        """Claim events until the policy or the stop rule says step; plan up to ``ahead`` steps (main worker).

        It runs on the prefetch thread while the previous plans train: it reads and moves only the planning
        cursor, never the trained position."""
        src = self.source
        self._acknowledge()
        steps, base, offset = self._cursor
        now = time.monotonic()
        if now - self._checked >= _CHECK_EVERY_S:
            # Raises if entries after the position were trimmed away: they would be skipped silently otherwise.
            self._added, self._checked = src.check(base, offset if offset >= 0 else None), now
        if self.stop.steps is not None and steps >= self.stop.steps:
            self._log, self._claimed_to = [], None  # close() un-claims them
            return [Plan(END, position=base, offset=offset, lag=self._lag(offset))]
        want = self.world_size * self.batch_size
        keepalive = time.monotonic() + _KEEPALIVE_S
        while True:
            now = time.monotonic()
            have = sum(1 for _, s in self._log if s is not DEAD)
            if have and self._first_wait is None:
                self._first_wait = now
            ended = self._ended or self.stop.reached(steps=steps, elapsed_s=now - self._t0,
                                                     idle_s=now - self._last_event)
            if ended or self.policy.ready(have=have, want=want, world_size=self.world_size,
                                          waited_s=now - (self._first_wait or now)):
                break
            if self._halt.is_set() or (now >= keepalive and self.world_size > 1):
                return [Plan(WAIT)]  # what is claimed stays claimed; the other workers just hear we are alive
            self._claim(want)
        return self._cut(want, ended)

    def _claim(self, want: int) -> None:
        """Claim up to ``ahead`` steps' worth into the log, one step's worth per read: the first read waits
        up to ``block_s`` (live, it brings what has arrived), the next ones take only what is there (a
        backlog). Reading in pieces hands the GIL back to the training thread at every round trip, so it
        never waits for a whole plan's parsing and decoding to get it back."""
        # Room counts good events only: dead letters in the log must not stop the claims that complete a step.
        have = sum(1 for _, s in self._log if s is not DEAD)
        src, room, block_s = self.source, self.ahead * want - have, self.block_s
        while room > 0 and not self._ended:
            asked = min(want, room)
            events = src.claim(asked, block_s)
            if not events:
                return
            self._last_event, block_s, room = time.monotonic(), 0.0, room - len(events)
            end = next((k for k, e in enumerate(events) if END_FIELD in e.fields), None)
            if end is not None:
                self._ended = True  # entries after the marker were claimed too: close() un-claims them
                self._claimed_to, events = events[end].id, events[:end]
            elif events:
                self._claimed_to = events[-1].id
            kept, reasons = self._decoder.check(events)
            for event, why in zip(events, reasons):
                if why is not None:
                    src.dead_letter(event, why)  # at most once per entry, even when a rewind reads it again
            self._log.extend(zip([e.id for e in events], kept))
            room += len(events) - sum(1 for k in kept if k is not DEAD)  # dead letters take no room
            if len(events) < asked:
                return

    def _cut(self, want: int, ended: bool) -> list[Plan]:
        """Cut what was claimed into steps: every full global batch (up to ``ahead``), then, when the run ends or
        the policy stepped on a partial batch, one last step of the rest."""
        steps, base, offset = self._cursor
        room = self.ahead if self.stop.steps is None else min(self.ahead, self.stop.steps - steps)
        slices, log = [], self._log
        while len(slices) < room:
            good, cut = 0, None
            for k, (_, sample) in enumerate(log):
                good += sample is not DEAD
                if good == want:
                    cut = k + 1
                    break
            if cut is None:
                break
            slices.append(log[:cut])
            log = log[cut:]
        rest = sum(1 for _, s in log if s is not DEAD)
        if rest and len(slices) < room and (ended or not slices):  # the end, or the policy stepped on a part
            slices.append(log)
            log = []
        elif ended and not rest and slices:  # only dead letters after the last batch: the last step covers them
            slices[-1] = slices[-1] + log
            log = []
        final = ended and not log
        self._log = log
        self._first_wait = time.monotonic() if log else None  # (approximate: the rest waits from now on)
        plans = []
        for n, part in enumerate(slices):
            last = n == len(slices) - 1
            position = self._claimed_to if last and final and self._claimed_to else part[-1][0]
            consumed = len(part) + (1 if last and final and self._ended else 0)
            offset = offset + consumed if offset >= 0 else -1
            take = [(i, s) for i, s in part if s is not DEAD]
            plan = Plan(STEP, total=len(take), final=last and final, consumed=consumed, lag=self._lag(offset),
                        dead=len(part) - len(take), position=position, offset=offset,
                        parts=split([i for i, _ in take], self.world_size), structure=self._decoder.expected)
            mine = take[:plan.parts[0][2]]
            plan.mine = ([i for i, _ in mine], self._decoder.collate([p for _, p in mine]))
            plans.append(plan)
        if not plans:  # the run ended with nothing to train: move past dead letters and the marker
            consumed = len(log) + (1 if self._ended else 0)
            offset = offset + consumed if offset >= 0 else -1
            self._log = []
            plans.append(Plan(END, consumed=consumed, lag=self._lag(offset), dead=len(log),
                              position=self._claimed_to or base, offset=offset, structure=self._decoder.expected))
        self._cursor = (steps + sum(p.status == STEP for p in plans), plans[-1].position, plans[-1].offset)
        return plans

    def _lag(self, offset: int) -> int:
        """Entries the producer had added (at the last check) that no step reached yet; -1 when unknown."""
        return max(0, self._added - offset) if offset >= 0 else -1

    # -- every worker's side ------------------------------------------------------------
    def _fetcher(self) -> ThreadPoolExecutor:
        if self._prefetch is None:
            self._prefetch = ThreadPoolExecutor(1, thread_name_prefix="phalanx-stream-prefetch")
        return self._prefetch

    def _my_part(self, plan: Plan) -> tuple[list[str], Any]:
        try:
            return plan.mine.parts.result()[plan.mine.index] if isinstance(plan.mine, Fetched) else plan.mine
        except StreamError as err:
            raise StreamError(f"worker {self.rank} lost the stream while fetching its part: {err}") from None

