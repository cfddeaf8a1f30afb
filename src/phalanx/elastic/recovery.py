"""What happens after a membership change: roll back, reshard, and let joiners take rank 0's state.

When a peer dies the survivors leave the broken group, agree on the next generation and on the
newest commit they all hold (:mod:`phalanx.elastic.state`), rebuild the group without the dead,
restore that commit and reshard a sharded model over the new group. The data position is counted
in samples, so the rest of the epoch is re-split over the new world size: no sample is dropped or
trained twice. Joiners admitted at a commit point, or at a regroup, take rank 0's newest commit.

:class:`Recovery` is the half of ``px.elastic.State`` that does this; it works on the state's
commits and objects (``self.commits``, ``self.training``, ``self.worker``, ...).
"""
from __future__ import annotations

import os
import sys
import time
import warnings
from typing import Any

import torch

from ..group import group, leaving
from ..checkpoint import checkpoint_step, load_checkpoint, save_checkpoint
from ..group.transfer import broadcast_state
from ..step import telemetry
from ..sharding.reshard import ShardLostError, let_go, reshard, reshard_empty
from ..sharding.layout import sharded_by

from ..checkpoint.training_state import shared
from .rule import Regroupable
from .run import is_peer_failure


def cloned(obj: Any) -> Any:
    """``obj`` with every tensor in its containers cloned where it lies (no storage shared with ``obj``).

    Example:
        >>> import torch; t = torch.zeros(2); c = cloned({"a": [t]}); _ = c["a"][0].add_(1); t.tolist()
        [0.0, 0.0]
    """
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone()
    if isinstance(obj, dict):
        return type(obj)((k, cloned(v)) for k, v in obj.items())  # keeps an OrderedDict one
    if isinstance(obj, (list, tuple)):
        return type(obj)(cloned(v) for v in obj)
    return obj


class Recovery:
    """Rollback, regroup and admission for ``px.elastic.State`` (a mixin: its attributes are the state's)."""

    def recover(self, failure: str, failed_at: float | None = None) -> None:
        """Leave the broken group, agree on the next one, roll back to the common commit (collective)."""
        started, failed_at = time.monotonic(), time.time() if failed_at is None else failed_at
        before = group.world_size()
        shard = sharded_by(self.optimizer)
        if shard is not None:
            # FSDP's modules and the DTensors' meshes hold this generation's subgroups, and gloo closes their
            # sockets only when they are freed: let go of them before the rebuild destroys the groups, so that a
            # peer of another replica group blocked in an all-reduce with us fails at once, not at its timeout.
            # The commit holds this worker's shards; _reshard lays them out on the next generation.
            let_go(self.model, self.optimizer, self.training.strategy)
        plan = self.worker.rebuild(sorted(self.commits), backend=group.current().backend or "gloo")
        snap = self._unshared(self.commits[plan["step"]])
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
        self._checkpoint_resumed()
        leaving.give_back_freed_memory()  # the old generation's buffers, freed in threads now gone
        self._note(plan, before, started, redone=lost_steps, cause=failure,
                   redone_s=max(0.0, failed_at - snap["elastic_time"]))


    def grow(self, joiners: list[str]) -> None:
        """Members at a commit point: rebuild with the joiners and send them rank 0's state (collective)."""
        started, before = time.monotonic(), group.world_size()
        plan = self.worker.grow(joiners, backend=group.current().backend or "gloo")
        self._send_state()
        self._reshard(self._unshared(self.commits[max(self.commits)]))  # taken at this commit point: the live state
        self._resplit(before)
        self._checkpoint_resumed()  # the commit point's save wrote it: nothing to write, unless that save failed
        leaving.give_back_freed_memory()  # the old generation's buffers, freed in threads now gone
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
        self._checkpoint_resumed()  # with the members, when the commit they resumed is not on disk
        leaving.give_back_freed_memory()  # the old generation's buffers, freed in threads now gone
        self._note(plan, 0, started, redone=0, cause="joined")
        return True

    def _unshared(self, commit: dict) -> dict:
        """What a rollback restores from ``commit``: a copy of the state it would otherwise take by reference.

        The commit is kept: a loss before the next commit rolls back to it again. But restoring hands some of its
        tensors over as they are: torch's ``Optimizer.load_state_dict`` casts each state tensor with ``.to``, which
        returns the same tensor when dtype and device already match (a CPU model), and a sharded model's reshard
        takes its rows and moments as the new shards. The steps after the rollback would then update the commit
        itself in place (momentum, Adam's moments and step count), and the second rollback to it restored the
        commit's model with those later moments. The model of an unsharded commit is copied into the parameters by
        ``load_state_dict``: it is not copied here.
        """
        keep = {"model"} if sharded_by(self.optimizer) is None else set()
        return {k: v if k in keep else cloned(v) for k, v in commit.items()}

    def _send_state(self) -> dict:
        """Rank 0's newest commit on every worker: its layout weights-only, its tensors streamed as raw bytes in
        chunks into tensors allocated here (:func:`phalanx.group.transfer.broadcast_state`), never one blob.

        Of a sharded model, without its model and optimizer: their shards travel point to point in
        :meth:`_reshard`, each worker receiving only the rows of its new shards."""
        mine = self.commits[max(self.commits)] if group.rank() == 0 else None
        if mine is not None and sharded_by(self.optimizer) is not None:
            mine = {**mine, "model": None, "optimizer": None, "rows": None}
        return broadcast_state(mine, 0, "newest commit")

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
        snap = self._unshared(self.commits[step])
        self._restore(snap)
        if joined:
            self._send_state()  # the commit of the checkpoint's step: the newest one kept
        self._load_shards()
        if group.rank() == 0:
            print(f"phalanx: elastic: {lost.lost} of the commit died with its only holder; the model and optimizer "
                  f"of step {step} come from {os.fspath(self.checkpoint)!r}", file=sys.stderr, flush=True)
        return snap

    def _checkpoint_resumed(self) -> None:
        """A sharded model with ``State(checkpoint=DIR)``: write the commit the group resumed from, when the disk
        holds another step (collective: every member and joiner of the new generation, the same answer on each,
        read from the same directory after the last save of the old generation ended).

        Why: a lost shard comes back from the disk only together with the commit of the checkpoint's step (data
        position, record, the rule's state), and a worker keeps its two newest commits. Every commit writes its
        checkpoint, but a loss inside a commit, after the in-memory capture and before the save, lets the survivors
        resume a commit the disk lacks. One more such loss and they held the two commits after the checkpoint's
        step, not its own: a layout of one replica group then lost a shard for good (the chaos soak's ``--shard 2``:
        ``ShardLostError``, "holds step 28, no commit held here"). Writing here keeps the disk at the newest commit
        resumed, at most one commit behind the newest held, so the checkpoint's commit is always in the ring.
        Keeping a third, pinned commit instead would cost a third copy of the shards in memory, and would not reach
        a joiner admitted at a regroup, which holds only the commit it was sent.
        """
        if self.checkpoint is None or sharded_by(self.optimizer) is None:
            return
        if checkpoint_step(self.checkpoint) == self.step:
            return
        save_checkpoint(self.checkpoint, self.model, self.optimizer, step=self.step)
        if group.rank() == 0:
            print(f"phalanx: elastic: the commit of step {self.step} resumed here was not on disk (a loss cut its "
                  f"save short); wrote it to {os.fspath(self.checkpoint)!r}", file=sys.stderr, flush=True)

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

    def _resplit(self, before: int) -> None:
        """The rest of the epoch, re-split over the new group; ``before``: the world the live state was built for."""
        sampler = getattr(self.loader, "sampler", None)
        if sampler is not None and hasattr(sampler, "reassign"):  # px.shard's: the position counts samples
            sampler.reassign(group.rank(), group.world_size())
        self.resize.resized(self.loader, before=before, after=group.world_size())
        strategy = self.training.strategy  # px.wrap's, or the one a Keras run's optimizer state carries
        if isinstance(strategy, Regroupable):
            strategy.regroup()

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
        reporter = telemetry.of()  # `phalanx run --status`: the page lists the change and its cost
        if reporter is not None:
            reporter.changed(self.history[-1])
        if group.rank() == 0:
            print(f"phalanx: elastic: generation {plan['generation']}: {before} -> {group.world_size()} workers "
                  f"(left: {', '.join(plan['left']) or '-'}; joined: {', '.join(plan['joined']) or '-'}); "
                  f"resuming from the commit at step {self.step}: {redone} finished step(s) to redo, "
                  f"{redone_s:.2f}s of work since that commit lost; regrouped in {seconds:.2f}s",
                  file=sys.stderr, flush=True)  # finished steps and lost seconds differ: a step in flight is lost too
