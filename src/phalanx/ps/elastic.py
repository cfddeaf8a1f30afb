"""How asynchronous PS training (Downpour, async EASGD) follows an elastic job's worker group.

Under ``phalanx run --elastic --servers K`` the servers outlive every worker, and hold the
model. Three rules keep every sample trained exactly once in the final model's history:

* **A commit is one consistent cut** (:meth:`FollowsElasticGroup.settle`): every worker
  waits for the others just before and just after it, so the servers' snapshot in each
  worker's commit holds every push up to the commit's step and none after it.
* **A rollback puts the servers back** to that snapshot (rank 0 sends it), before anyone
  passes the barrier of :meth:`FollowsElasticGroup.regroup`. The pushes made after the
  commit, the dead worker's and the survivors', are taken back; the survivors redo those
  steps on the re-split data, exactly as synchronous training does.
* **A joiner never puts them back** (:meth:`FollowsElasticGroup.load_joiner_state_dict`):
  it takes rank 0's step count, optimizer and data position and, as its model, the
  servers' shards as they are (a pull after the barrier). Nobody rolls back.

Outside ``--elastic`` all of this does nothing.

Example (one worker, not elastic: nothing to wait for):
    >>> import torch, phalanx as px
    >>> net = torch.nn.Linear(2, 1)
    >>> model, opt = px.wrap(net, torch.optim.SGD(net.parameters(), lr=0.1), strategy=px.Downpour())
    >>> px.strategy_of(opt).settle(); px.strategy_of(opt).finish()
"""
from __future__ import annotations

from typing import Any

from .. import group


class FollowsElasticGroup:
    """What a PS strategy does around commits, rollbacks and joins (mixed into ``PSStrategy``)."""

    def settle(self) -> None:
        """Under ``--elastic``, just before and just after each commit: wait for every worker (collective).

        Before: every worker's exchanges up to this step have reached the servers, so the
        snapshot in the commit holds them all. After: no one's next exchange lands before
        every worker took its snapshot. The commit is then one consistent cut of the data
        position and the servers' shards, and a rollback to it trains each sample exactly
        once in the final model's history. Elsewhere (no group, or servers holding no model)
        it does nothing.
        """
        if self.servers_hold_the_model and group.is_elastic() and group.world_size() > 1:
            self.comm.barrier()  # type: ignore[attr-defined]

    def load_joiner_state_dict(self, state: dict[str, Any]) -> None:
        """A worker joining a running ``--elastic`` job: rank 0's step count, and the servers as they are now.

        Unlike :meth:`load_state_dict` (a rollback or a resume), this never puts the servers
        back to the snapshot in ``state``: the members go on from the servers' current shards
        and so does the joiner, whose model becomes those shards (a pull).
        """
        super().load_state_dict({k: v for k, v in state.items() if k != "servers"})  # type: ignore[misc]
        self._pull_at_regroup = self.servers_hold_the_model  # after every member passed regroup()'s barrier

    def regroup(self) -> None:
        """Under ``--elastic``, after a change, on every member of the new group: one barrier.

        A rollback's ``set`` (rank 0, in :meth:`load_state_dict`) is on the servers before
        anyone passes it, so no one's next push is overwritten and a joiner's pull sees it.
        """
        if not self.servers_hold_the_model:
            return
        self.comm.barrier()  # type: ignore[attr-defined]
        from ..elastic.worker import generation
        self._generation = generation()
        if getattr(self, "_pull_at_regroup", False):
            self._pull_at_regroup = False
            self._exchange(self.table.pull)  # type: ignore[attr-defined]

    def _regroup_pending(self) -> bool:
        """Under ``--elastic``: the group changed and :meth:`regroup` has not run yet (we are rolling back)."""
        if not group.is_elastic():
            return False
        from ..elastic.worker import generation
        return generation() != getattr(self, "_generation", 0)
